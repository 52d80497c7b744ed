"""The service against a real local Prefect server (`prefect server start` on a free loopback port, a temporary
PREFECT_HOME), started and stopped by a fixture: a served manual run decides acceptance on in-model correctness, the
nightly deployment registers with its schedule and concurrency limit, the change event starts the on-change
deployment with the event's path, two nights keep two runs' rows, an injected infrastructure failure is retried,
and keep / replace / rollback on a tiny workload."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.triggers import EVENT, HashState, change_event, scan, watch
from llm4llm.config import OptimizeConfig
from storage import repo
from storage.db import Database

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, fn, timeout_s: float, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = fn()
        except Exception:  # noqa: BLE001 - not up yet
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: nothing after {timeout_s:.0f} s")
        time.sleep(every_s)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """A real Prefect server for this module, and this process's client pointed at it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        _wait("prefect server", lambda: urllib.request.urlopen(url + "/health", timeout=2).status == 200, 150)
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield SimpleNamespace(url=url, home=home, env={**env, "PREFECT_API_URL": url})
    finally:
        _stop(proc)
        log.close()


def _workloads(root: Path) -> SimpleNamespace:
    """tiny-llama as `w.toml` (CPU) and as `w-gpu.toml` (device cuda), with their own copy of the script."""
    (root / "scripts").mkdir(parents=True)
    shutil.copy(EXAMPLES / "scripts" / "hf_generate.py", root / "scripts")
    (root / "workloads").mkdir()
    text = (EXAMPLES / "workloads" / "tiny-llama.toml").read_text()
    cpu = root / "workloads" / "w.toml"
    cpu.write_text(text)
    gpu = root / "workloads" / "w-gpu.toml"
    gpu.write_text(text.replace('name = "tiny-llama"', 'name = "tiny-llama-gpu"').replace('device = "cpu"',
                                                                                            'device = "cuda"'))
    return SimpleNamespace(dir=root / "workloads", cpu=cpu, gpu=gpu, script=root / "scripts" / "hf_generate.py")


@pytest.fixture(scope="module")
def served(prefect_server, tmp_path_factory):
    """`python -m deployments.serve` in its own process on the server, over the two tiny workloads."""
    from prefect import get_client

    root = tmp_path_factory.mktemp("served")
    w = _workloads(root)
    db = root / "db.duckdb"
    env = {**prefect_server.env, "PYTHONPATH": str(ROOT), "LLM4LLM_HOME": str(root / "home"),
           "TRITON_INTERPRET": "1", "LLM4LLM_AOT_ARCH": "0", "PREFECT_LOGGING_LEVEL": "INFO"}
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "deployments.serve", str(w.dir), "--db", str(db)], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with get_client(sync_client=True) as client:
            for name in ("nightly-workload/nightly-w", "optimize-workload/manual", "optimize-workload/on-change",
                         "profile-workload/manual"):
                _wait(f"served deployment {name}", lambda: client.read_deployment_by_name(name), 120)
        yield SimpleNamespace(w=w, db=db, data=root / "home", log=root / "serve.log", proc=proc)
    finally:
        _stop(proc)
        log.close()


def test_served_deployments_run_register_and_react_to_a_change_event(served):
    """The served process's three deployments, in one test: a server and a `deployments.serve` start cost ~40 s, and
    under pytest-xdist --dist worksteal the module's tests, split between the workers, started both twice."""
    _a_served_run_completes_as_a_manual_run_and_decides_on_in_model_correctness(served)
    _nightly_registers_with_schedule_and_concurrency_limit(served)
    _change_event_starts_the_on_change_deployment_with_its_path(served)


def _a_served_run_completes_as_a_manual_run_and_decides_on_in_model_correctness(served):
    """A manual run of the served `optimize-workload/manual` (a flow-run process that no CLI set up) completes as a
    run of kind `manual`, searches one RMSNorm task and tries its best candidate in the model: the decision checked
    in-model correctness (never an interpreter error: the served process runs Triton's interpreter on a CPU host as
    the CLI does)."""
    from prefect.deployments import run_deployment

    config = {"stages": ["profile", "extract", "search", "accept"], "time_budget_s": None,
              "search": {"budget": 1, "top": 1, "families": ["norm"]}}
    run = run_deployment("optimize-workload/manual", timeout=600,
                         parameters={"workload_path": str(served.w.cpu), "data_dir": str(served.data),
                                     "config": config})
    assert run.state.is_completed(), (run.state, served.log.read_text()[-3000:])
    with Database(served.db, read_only=True) as db:  # the run that this flow run recorded
        (run_id, name, kind, status), = db.query("SELECT run_id, workload_name, kind, status FROM runs "
                                                 "WHERE flow_run_id = ?", [str(run.id)])
        reasons = [r[0] for r in db.query("SELECT reason FROM acceptances WHERE run_id = ?", [run_id])]
    assert (name, kind, status) == ("tiny-llama", "manual", "ok")  # the kind from the deployment's name
    assert reasons and all("in-model correctness ok" in r for r in reasons), reasons
    assert not any("Interpreter" in r or "outside of the scope of a kernel" in r for r in reasons), reasons
    # the served flow's acceptance journalled each decision as it made it (what a stopped step keeps)
    journalled = [line for f in (served.data / "accept").glob(f"{run_id}*.jsonl")
                  for line in f.read_text().splitlines()]
    assert len(journalled) == len(reasons), (journalled, reasons)


def _nightly_registers_with_schedule_and_concurrency_limit(served):
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name("nightly-workload/nightly-w")
        assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]
        assert nightly.global_concurrency_limit is not None and nightly.global_concurrency_limit.limit == 1
        assert nightly.concurrency_options.collision_strategy == "ENQUEUE"  # a second night waits, never collides
        assert nightly.parameters["workload_path"] == str(served.w.cpu.resolve())
        assert nightly.entrypoint == "flows.nightly.nightly_workload"  # a module path: nothing shadows the stdlib
        with pytest.raises(ObjectNotFound):  # its device (cuda) is not on this host: not scheduled here
            client.read_deployment_by_name("nightly-workload/nightly-w-gpu")
    assert "nightly-w-gpu: not scheduled on this host" in served.log.read_text()


def _change_event_starts_the_on_change_deployment_with_its_path(served):
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    from deployments.triggers import emit

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("optimize-workload/on-change")
        _wait("the on-change automation", lambda: client.read_automations_by_name(
            "workload config or script changed"), 30)
        time.sleep(2)  # the server's trigger service loads new automations on its own cycle
        emit(change_event(served.w.cpu, "tiny-llama", "0123456789abcdef", None, "cpu"))
        runs = _wait("a run of optimize-workload/on-change", lambda: client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id]))), 60)
    assert len(runs) == 1
    run = runs[0]
    assert run.parameters["workload_path"] == str(served.w.cpu.resolve())
    assert run.parameters["config"] == {"stages": ["profile", "extract"]}
    assert run.parameters["db_path"] == str(served.db)
    assert run.created_by is not None and run.created_by.type == "AUTOMATION"  # the UI shows it as triggered


def _edit(path: Path, text: str) -> None:
    path.write_text(text)
    os.utime(path, None)


def test_only_a_real_change_emits(tmp_path):
    """The hash is of the parsed TOML and the script: a touch, an identical rewrite and a comment-only or
    whitespace edit emit nothing; a script edit and a value edit emit, once each."""
    w = _workloads(tmp_path)
    state = HashState(tmp_path / "state.json")
    got: list[dict] = []
    assert scan([w.dir], state, got.append, emit_new=False) == []  # first sight: the baseline
    text = w.cpu.read_text()
    w.cpu.touch()
    _edit(w.cpu, text)
    _edit(w.cpu, "# a comment the run does not read\n" + text.replace("decode_len = 4", "decode_len   =   4  # same"))
    assert scan([w.dir], state, got.append) == []
    _edit(w.script, w.script.read_text() + "\n# edited\n")
    events = scan([w.dir], state, got.append)
    assert sorted(e["resource"]["prefect.resource.id"] for e in events) == ["llm4llm.workload.tiny-llama",
                                                                            "llm4llm.workload.tiny-llama-gpu"]
    _edit(w.cpu, text.replace("decode_len = 4", "decode_len = 5"))
    (e,) = scan([w.dir], state, got.append)
    assert e["event"] == EVENT and e["payload"]["path"] == str(w.cpu.resolve())
    assert e["payload"]["previous_hash"] != e["payload"]["content_hash"]
    assert e["resource"]["llm4llm.device"] == "cpu"
    assert HashState(tmp_path / "state.json").hashes == state.hashes  # a restarted watcher starts from here
    assert scan([w.dir], HashState(tmp_path / "state.json"), got.append) == []


def test_watch_reacts_to_files_through_watchfiles(tmp_path):
    """The watcher itself (watchfiles, debounced): a comment-only edit emits nothing, a script edit in the
    script's own directory emits."""
    w = _workloads(tmp_path)
    got: list[dict] = []
    stop = threading.Event()
    t = threading.Thread(target=watch, args=([str(w.cpu)], tmp_path / "state.json", got.append, 100),
                         kwargs={"stop_event": stop}, daemon=True)
    t.start()
    time.sleep(1.5)
    _edit(w.cpu, w.cpu.read_text() + "\n# only a comment\n")
    time.sleep(1.5)
    assert got == []
    _edit(w.script, w.script.read_text() + "\n# edited\n")
    _wait("a change event", lambda: got, 15, 0.1)
    stop.set()
    t.join(10)
    assert [e["payload"]["path"] for e in got] == [str(w.cpu.resolve())]


def test_two_nights_keep_their_rows_and_an_infrastructure_failure_is_retried(prefect_server, tmp_path,
                                                                             monkeypatch, caplog):
    """Night 2 serves its profile from the cache and still gets a run id, searches, e2e rows and a decision of its
    own; its search starts from night 1's experience. A database write that fails once (infrastructure) is retried
    and the night completes."""
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    from flows.nightly import nightly_workload
    from llm4llm import isolation
    from llm4llm.stages import profile as profile_stage

    def in_this_process(fn, *args, timeout_s=None, poll=None, poll_every_s=None, outputs=None, readable=None,
                        extra_env=None, box=None, **kwargs):
        result = fn(*args, **kwargs, **(outputs or {}))  # outputs: written at their real paths, no sandbox here
        if poll:
            poll()
        return result

    # acceptance and e2e run in spawned processes for GPU isolation (tests/test_flows.py covers that path); here
    # the nights' bookkeeping is under test, so they run in this process (a process start costs ~10 s on the CPU)
    monkeypatch.setattr(isolation, "in_subprocess", in_this_process)
    w = _workloads(tmp_path)
    db, data = str(tmp_path / "db.duckdb"), str(tmp_path / "data")
    # the nights' rows are under test, not a kernel: one RMSNorm task (verified in a second under the interpreter,
    # where the hottest task, the fused decoder layer, costs ~15 s of applicability checks and a trial each night)
    cfg = OptimizeConfig(search={"budget": 1, "top": 1, "families": ["norm"]},
                         evaluate={"variants": ["eager"], "repeats": 1})
    one = nightly_workload(str(w.cpu), cfg, db_path=db, data_dir=data)
    real, calls = profile_stage.record_run, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("injected: the database volume is unavailable")
        return real(*args, **kwargs)

    monkeypatch.setattr(profile_stage, "record_run", flaky)  # where the record-profile task looks it up
    two = nightly_workload(str(w.cpu), cfg, db_path=db, data_dir=data)
    assert len(calls) == 2  # failed once, retried once
    one, two = one.optimize, two.optimize  # tonight's optimize run as it returned it
    assert one.run_id != two.run_id and one.profile_path == two.profile_path  # cached profile
    with Database(db) as d:
        runs = repo.get_run(d, two.run_id)
        assert runs["profile_of"] == one.run_id
        for night in (one, two):
            run = night.run_id
            assert d.query("select count(*) from profiles where run_id = ?", [run])[0][0] > 0
            assert d.query("select count(*) from tasks where run_id = ?", [run])[0][0] > 0
            assert d.query("select count(*) from searches where run_id = ?", [run])[0][0] == 1
            assert d.query("select variant from e2e_results where run_id = ?", [run + "-e2e"]) == [("eager",)]
        decisions = repo.service_decisions(d, "tiny-llama")
        transcripts = [r[0] for r in d.query("select e.transcript_path from episodes e join searches s "
                                             "using (search_id) where s.run_id = ?", [two.run_id])]
    assert list(decisions["run_id"]) == [one.run_id, two.run_id]
    assert list(decisions["decision"]) == ["keep", "keep"]  # the CPU accepts nothing: no bundle in service
    assert decisions["reason"].str.contains("no bundle in service and none accepted tonight").all()
    assert transcripts and json.loads(Path(transcripts[0]).read_text())["experience_in"]  # warm start
    # Task run states reach the server as events, over a websocket that Prefect's EventsWorker sends on and may
    # give up on under load ("Service 'EventsWorker' failed to process item", logged, the event dropped). The retry
    # itself is proved above (calls == 2 and the night's rows); the server must show it unless Prefect's own
    # transport logged that it dropped events.
    def retried():
        with get_client(sync_client=True) as client:
            return [t for t in client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(
                like_="record-profile"))) if t.run_count == 2 and t.state.is_completed()]

    try:
        assert len(_wait("the retried task run on the server", retried, 90)) == 1
    except TimeoutError:
        dropped = [r for r in caplog.records if "EventsWorker" in r.getMessage() and "failed" in r.getMessage()]
        assert dropped, "the retried task run never reached the server, and Prefect logged no dropped event"


def test_deploy_to_a_process_work_pool_routes_gpu_runs_to_a_one_slot_queue(prefect_server, tmp_path, capsys):
    """The work-pool path: a process pool, GPU nightly runs on queue gpu-cuda-0, staggered, every queue with one
    slot (one GPU run, one DuckDB writer at a time), the GPU global concurrency limit created. Prefect's advice
    about process pools is printed once, not once per deployment."""
    from prefect import get_client

    from deployments.deploy import deploy_all

    w = _workloads(tmp_path)
    ids = deploy_all([w.cpu, w.gpu], "llm4llm-test", "03:00", 45, None)
    out = capsys.readouterr()
    assert len(ids) > 2 and " ".join((out.out + out.err).split()).count("process work pool") == 1, out
    with get_client(sync_client=True) as client:
        assert client.read_work_pool("llm4llm-test").type == "process"
        queues = {q.name: q for q in client.read_work_queues(work_pool_name="llm4llm-test")}
        assert queues["gpu-cuda-0"].concurrency_limit == 1 and queues["cpu"].concurrency_limit == 1
        gpu = client.read_deployment_by_name("nightly-workload/nightly-w-gpu")
        assert gpu.work_queue_name == "gpu-cuda-0" and [s.schedule.cron for s in gpu.schedules] == ["45 3 * * *"]
        assert client.read_deployment_by_name("optimize-workload/on-change-gpu-cuda-0").work_queue_name == "gpu-cuda-0"
        assert client.read_global_concurrency_limit_by_name("gpu-cuda-0").limit == 1


def test_keep_replace_rollback_on_a_tiny_workload(tmp_path, monkeypatch):
    """Bundles for tiny-llama's RMSNorm, re-validated in the model each night: none in service + a passing bundle ->
    replace (v1, `current` -> v0001); v1 still passing -> keep, its latency gate reported skipped on the CPU; a
    version that fails tonight -> rollback to the last one that passes (v1), and with none that passes -> none."""
    from kernels_runtime.bundle import save_bundle
    from llm4llm import nightly, service
    from storage.store import Store
    from tests.test_runtime import RMSNORM_SOURCE, rmsnorm_bundle

    # in this process (the flow runs each check in its own): the same check, without a process start per bundle
    monkeypatch.setattr(nightly, "_revalidate", service.revalidate)
    w = _workloads(tmp_path)
    db, data = str(tmp_path / "db.duckdb"), str(tmp_path / "data")
    good = str(save_bundle(rmsnorm_bundle(), tmp_path / "good"))
    wrong = RMSNORM_SOURCE.replace("(w * xn)", "(w * xn * 1.5)")
    assert wrong != RMSNORM_SOURCE
    bad = str(save_bundle(rmsnorm_bundle(source=wrong), tmp_path / "bad"))

    def night(run_id: str, candidate: str | None) -> dict:
        current = nightly.validate_in_service(str(w.cpu), Store(db))
        return nightly.decide_night(str(w.cpu), run_id, candidate, current, Store(db), data)

    home = Path(data) / "bundles" / "tiny-llama"
    first = night("n1", good)
    assert (first["decision"], first["from_version"], first["to_version"]) == ("replace", None, 1)
    assert (home / "current").resolve() == (home / "v0001").resolve() and (home / "v0001" / "manifest.json").exists()
    second = night("n2", bad)  # tonight's bundle is wrong in-model: the one in service stays
    assert (second["decision"], second["to_version"]) == ("keep", 1)
    assert "tonight's fails: in-model correctness fails" in second["reason"]
    # an earlier night put a bundle in service that fails tonight (as after a library or workload change)
    with Database(db) as d:
        shutil.copytree(bad, home / "v0002")
        repo.record_bundle_version(d, {"workload_name": "tiny-llama", "version": 2, "run_id": "n2",
                                       "workload_hash": "-", "bundle_path": str(home / "v0002"), "digest": "-"})
        repo.set_current_bundle(d, "tiny-llama", 2, "n2")
    third = night("n3", None)
    assert (third["decision"], third["from_version"], third["to_version"]) == ("rollback", 2, 1)
    assert "rolled back to version 1" in third["reason"] and (home / "current").resolve() == (home / "v0001").resolve()
    with Database(db) as d:
        rows = repo.service_decisions(d, "tiny-llama")
        vals = d.query_df("select * from bundle_validations order by created_at")
        cur = repo.current_bundle(d, "tiny-llama")
        versions = repo.bundle_versions(d, "tiny-llama")
        with pytest.raises(Exception, match="(?i)constraint|duplicate"):  # a version is never overwritten
            repo.record_bundle_version(d, {"workload_name": "tiny-llama", "version": 1, "run_id": "x",
                                           "workload_hash": "-", "bundle_path": "-", "digest": "-"})
    assert list(rows["decision"]) == ["replace", "keep", "rollback"] and rows["reason"].str.len().min() > 20
    assert cur["version"] == 1 and [v["version"] for v in versions] == [2, 1]
    passing = vals[vals["ok"]]
    assert (passing["latency"] == "skipped: cpu").all() and len(passing) >= 3
    assert vals[~vals["ok"]]["correctness"].str.startswith("failed: logits_rel_l2").all()
    # nothing passes tonight: no bundle in service
    with Database(db) as d:
        repo.set_current_bundle(d, "tiny-llama", 2, "n3")
    monkeypatch.setattr(nightly, "_revalidate", lambda wl, path, cfg=None: service.revalidate(wl, bad, cfg))
    fourth = night("n4", None)
    assert (fourth["decision"], fourth["to_version"]) == ("rollback", None)
    assert "no earlier version passes" in fourth["reason"] and not (home / "current").exists()


def test_decide_prefers_a_faster_bundle_only_by_delta():
    """The GPU side of the decision, on measured validations: tonight's bundle replaces a passing one only when it
    runs faster by delta relative to the unpatched model beside it; a regressed bundle in service is replaced."""
    from llm4llm.service import Validation, decide

    def v(unpatched, patched, ok=True):
        return Validation("b", ok, "ok", "ok" if ok else "regressed", unpatched, patched, 1 - patched / unpatched)

    assert decide(v(100, 50), v(80, 40), None, 0.02).decision == "keep"  # same ratio: not faster by delta
    d = decide(v(100, 50), v(80, 38), None, 0.02)
    assert (d.decision, d.target) == ("replace", "candidate") and "0.475" in d.reason
    regressed = v(100, 110, ok=False)
    assert (decide(regressed, None, None).decision, decide(regressed, None, None).target) == ("rollback", None)
    assert decide(regressed, v(100, 60), None).decision == "replace"
    assert decide(regressed, None, v(100, 70), fallback_version=3).reason.count("version 3") == 1
    assert decide(None, None, None).decision == "keep" and decide(None, v(100, 90), None).decision == "replace"
