"""A run across hosts: network namespaces made by the test stand for hosts, joined by veth links to a
bridge in a namespace of its own (nothing is added to the machine's own network). The scheduler and
the driver run on one "host", the two training ranks on two others (their process group's TCPStore
and gloo pairs over the veth addresses), the rollout engine and a plain worker on a fourth; the
cluster is started as docs/reliability.md and docs/scaling.md tell a user to start one (`dask
scheduler --tls-...`, `dask worker --tls-... --resources ...`, the driver's certificate in its Dask
config). A training worker killed on its host mid-run is restarted by its nanny there and the step
rerun. The run equals the embedded one-host run bit for bit, and the scheduler refuses clients
without a certificate of the run's authority: plain TCP, TLS without a certificate, TLS with
another authority's. Needs root (namespaces); skipped elsewhere."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.cluster import worker_resources
from flows.config import load_config
from flows.deploy import TLSFiles, worker_command
from tests.conftest import TINY_CLI_ITERATIONS, TINY_CLI_OVERRIDES, assert_same_runs, pids_where

pytestmark = [pytest.mark.slow, pytest.mark.system]

ITERATIONS = TINY_CLI_ITERATIONS  # the one-host run is the session's tiny_cli_run, with the same overrides
NET = f"gf{os.getpid()}"  # namespace names: NET-bridge, NET-<host>
SUBNET = "10.77.0"
# host -> (its address, the workers it runs); the workers' resources are the config's (flows/deploy.py)
HOSTS = {"head": (f"{SUBNET}.10", ()), "train-a": (f"{SUBNET}.11", ("train-0",)),
         "train-b": (f"{SUBNET}.12", ("train-1",)), "gen": (f"{SUBNET}.13", ("rollout-0", "plain-0"))}
SCHEDULER_PORT = 8786
DASK = str(Path(sys.executable).parent / "dask")  # the CLI a user runs


def _certificates(folder: Path, name: str, addresses: tuple[str, ...] = ("127.0.0.1",)) -> dict[str, Path]:
    """A certificate authority's cert and a key + cert it signed for ``addresses``, as PEM files."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject: str, key, issuer: str, signer, ca: bool):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [*(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses), x509.DNSName("localhost")]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    paths = {"ca": folder / f"{name}-ca.pem", "cert": folder / f"{name}.pem", "key": folder / f"{name}.key"}
    paths["ca"].write_bytes(cert(f"{name} CA", ca_key, f"{name} CA", ca_key, True).public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert("grpoflow", key, f"{name} CA", ca_key, False).public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


def _tls_env(p: dict[str, Path]) -> dict[str, str]:
    return {"DASK_DISTRIBUTED__COMM__TLS__CA_FILE": str(p["ca"]),
            "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT": str(p["cert"]),
            "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY": str(p["key"]),
            "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True"}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _namespaces() -> None:
    """NET-bridge holding a bridge; per host a namespace whose eth0 is a veth link to it."""
    _ip("netns", "add", f"{NET}-bridge")
    _ip("-n", f"{NET}-bridge", "link", "add", "br0", "type", "bridge")
    _ip("-n", f"{NET}-bridge", "link", "set", "br0", "up")
    for i, (host, (address, _)) in enumerate(HOSTS.items()):
        ns = f"{NET}-{host}"
        _ip("netns", "add", ns)
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", f"{NET}-bridge")
        _ip("-n", f"{NET}-bridge", "link", "set", f"p{i}", "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def _remove_namespaces() -> None:
    for ns in (f"{NET}-{h}" for h in (*HOSTS, "bridge")):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _on(host: str, command: list[str]) -> list[str]:
    return ["ip", "netns", "exec", f"{NET}-{host}", *command]


def _worker_process(nanny: int) -> int | None:
    """The worker process a ``dask worker`` nanny runs (multiprocessing's spawn child)."""
    for pid in pids_where("ppid", nanny):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


@pytest.fixture
def hosts(tmp_path):
    """(scheduler address, the run's certificate files, the environment its processes share,
    nanny pid per worker name); the namespaces and every process removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    try:
        _namespaces()
    except (OSError, subprocess.SubprocessError) as exc:
        _remove_namespaces()
        pytest.skip(f"cannot make network namespaces here: {exc}")
    certs = _certificates(tmp_path, "run", tuple(a for a, _ in HOSTS.values()))
    env = {**os.environ, "GRPOFLOW_CACHE": str(tmp_path / "cache"), "PYTHONPATH": os.getcwd(),
           "GLOO_SOCKET_IFNAME": "eth0", "DASK_LOGGING__DISTRIBUTED": "warning"}
    head = HOSTS["head"][0]
    address = f"tls://{head}:{SCHEDULER_PORT}"
    tls = TLSFiles(ca=str(certs["ca"]), cert=str(certs["cert"]), key=str(certs["key"]))
    resources = worker_resources(load_config("configs/tiny.yaml", [o for o in TINY_CLI_OVERRIDES if "=" in o]))
    assert sorted(resources) == sorted(n for _, names in HOSTS.values() for n in names)
    procs, nannies = [], {}
    try:
        procs.append(subprocess.Popen(_on("head", [DASK, "scheduler", "--protocol", "tls", "--host", head,
                                                   "--port", str(SCHEDULER_PORT), "--dashboard-address", f"{head}:0",
                                                   *tls.args()]),
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
        for host, (ip, names) in HOSTS.items():
            for name in names:
                command = worker_command(name, resources[name], address, tls, host=ip)
                proc = subprocess.Popen(_on(host, [DASK, *command[1:], "--dashboard-address", f"{ip}:0"]),
                                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
                procs.append(proc)
                nannies[name] = proc
        yield address, certs, env, nannies
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        _remove_namespaces()


def test_a_run_across_hosts_equals_the_one_host_run(tmp_path, hosts, tiny_cli_run):
    address, certs, env, nannies = hosts
    runs = tmp_path / "hosts"
    driver = subprocess.Popen(_on("head", [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml",
                                           f"runs_dir={runs}", *TINY_CLI_OVERRIDES,
                                           f"cluster.scheduler_address={address}"]),
                              env={**env, **_tls_env(certs)}, stdout=subprocess.DEVNULL,
                              stderr=(tmp_path / "driver.err").open("w"), start_new_session=True)

    def err() -> str:
        return (tmp_path / "driver.err").read_text()[-3000:]

    # Kill training rank 1's worker process on its host while step 0 runs (step 1's Zarr group is
    # prepared then).
    deadline, killed = time.time() + 400, None
    while killed is None:
        assert driver.poll() is None, err()
        assert time.time() < deadline, "step 1's group was never prepared"
        if (runs / "r" / "rollouts.zarr" / "step_1").exists():
            killed = _worker_process(nannies["train-1"].pid)
            if killed:
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.1)
    assert driver.wait(timeout=600) == 0, err()
    assert "training worker train-1 was lost" in err(), err()  # the loss was seen and the step rerun
    restarted = _worker_process(nannies["train-1"].pid)
    assert restarted and restarted != killed, "train-1's nanny did not restart its worker"
    assert_same_runs(tiny_cli_run, runs / "r", ITERATIONS, min_weight_files=2 * ITERATIONS)

    # A TLS client that trusts the scheduler but shows no certificate: the handshake is refused
    # (TLS 1.3 reports it at the client's first read).
    probe_tls = ("import socket, ssl, sys\n"
                 "ctx = ssl.create_default_context(cafile=sys.argv[3]); ctx.check_hostname = False\n"
                 "raw = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)\n"
                 "try:\n    ctx.wrap_socket(raw).recv(1)\nexcept (ssl.SSLError, ConnectionResetError) as exc:\n"
                 "    print('refused', type(exc).__name__)\nelse:\n    print('connected')\n")
    out = subprocess.run(_on("head", [sys.executable, "-c", probe_tls, HOSTS["head"][0], str(SCHEDULER_PORT),
                                      str(certs["ca"])]), capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("refused"), f"no certificate: {out.stdout} {out.stderr[-1500:]}"
    # Dask clients on another host: plain TCP, TLS with another authority's certificate, the run's own.
    other = _certificates(tmp_path, "other")
    probe = ("import sys\nfrom distributed import Client\n"
             "try:\n    Client(sys.argv[1], timeout='5s').close()\nexcept Exception as exc:\n"
             "    print('refused', type(exc).__name__)\nelse:\n    print('connected')\n")
    clients = {"tcp": (address.replace("tls://", "tcp://"), {}, "refused"),
               "another authority": (address, _tls_env(other), "refused"),
               "the run's certificate": (address, _tls_env(certs), "connected")}
    for who, (addr, extra, expected) in clients.items():
        out = subprocess.run(_on("gen", [sys.executable, "-c", probe, addr]), env={**env, **extra},
                             capture_output=True, text=True, timeout=120)
        assert out.stdout.startswith(expected), f"{who}: {out.stdout} {out.stderr[-1500:]}"
