"""Run inside the sandbox: build and import a C extension the way Triton builds its launcher and driver utils
(the compiler found on PATH, Python's headers, -O3 -shared -fPIC, the .so in the private dir), then check that a
shell is still refused."""
import importlib.util
import json
import os
import shutil
import subprocess
import sysconfig
import tempfile

SRC = r"""
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "l4l_probe_ext", NULL, -1, methods};
PyMODINIT_FUNC PyInit_l4l_probe_ext(void) { return PyModule_Create(&mod); }
"""
res = {}
cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
d = tempfile.mkdtemp()
src = os.path.join(d, "l4l_probe_ext.c")
so = os.path.join(d, "l4l_probe_ext" + sysconfig.get_config_var("EXT_SUFFIX"))
open(src, "w").write(SRC)
p = subprocess.run([cc, src, "-O3", "-shared", "-fPIC", "-o", so, f"-I{sysconfig.get_paths()['include']}"],
                   capture_output=True, text=True)
res["cc_rc"], res["cc_err"] = p.returncode, p.stderr[-1500:]
if p.returncode == 0:
    spec = importlib.util.spec_from_file_location("l4l_probe_ext", so)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    res["answer"] = m.answer()
try:
    subprocess.run(["/bin/sh", "-c", "true"], check=True)
    res["shell"] = "allowed"
except (OSError, subprocess.CalledProcessError) as e:
    res["shell"] = f"denied: {type(e).__name__}"
print(json.dumps(res))
