"""Run inside the sandbox by tests/test_sandbox.py: tries what a hostile candidate would, prints one JSON line
{attempt: "allowed ..." | "denied ..."}. Paths to attack come from argv: a secret file, the database file."""
import json
import os
import signal
import socket
import subprocess
import sys

secret_file, db_file, parent = sys.argv[2], sys.argv[3], int(sys.argv[4])
r = {}


def t(name, fn):
    try:
        r[name] = "allowed " + repr(fn())[:80]
    except Exception as e:  # noqa: BLE001
        r[name] = f"denied {type(e).__name__}: {e}"[:160]


t("read_outside", lambda: open(secret_file).read())
t("read_etc_passwd", lambda: open("/etc/passwd").read(20))
t("list_root_home", lambda: os.listdir("/root"))
t("write_db", lambda: open(db_file, "r+b").write(b"x"))
t("delete_db", lambda: os.unlink(db_file))
t("write_tmp", lambda: open("/tmp/llm4llm-sandbox-escape", "w").write("x"))
t("connect_inet", lambda: socket.create_connection(("127.0.0.1", 22), timeout=1))
t("socket_inet6", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM))
t("socket_netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
t("spawn_shell", lambda: subprocess.run(["/bin/sh", "-c", "echo escaped"], capture_output=True).stdout)
t("spawn_python", lambda: subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).stdout)
t("new_session", lambda: os.setsid())
t("signal_parent", lambda: os.kill(parent, signal.SIGTERM))
t("signal_parent_probe", lambda: os.kill(parent, 0))
t("signal_self_term", lambda: os.kill(os.getpid(), signal.SIGTERM))
t("parent_environ", lambda: open(f"/proc/{parent}/environ").read())
t("secret_in_env", lambda: [k for k, v in os.environ.items() if "SANDBOXTESTSECRET" in v] or None)
t("write_own_dir", lambda: open("mine.txt", "w").write("ok"))
r["uid"] = os.getuid()
print(json.dumps(r))
