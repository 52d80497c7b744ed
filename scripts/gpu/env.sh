# Source at the start of every device call: installs the carried wheels (prefect, duckdb; as wheels or as scripts/gpu/pack_site.sh's site.tar.xz) and records versions.
if [ -f .whl/site.tar.xz ]; then mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site; fi  # scripts/gpu/pack_site.sh
# loose wheels beside it (or instead of it): e.g. liger-kernel for the `liger` baseline
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_HOME=/tmp/prefect \
       PREFECT_LOGGING_LEVEL=WARNING PYTHONUNBUFFERED=1 LLM4LLM_HOME=/tmp/l4l
mkdir -p "$OUT/logs"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv;
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
