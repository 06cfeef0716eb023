"""A run on a Dask cluster of one's own started with TLS, as docs/reliability.md tells a user to
start one across hosts (`dask scheduler --tls-...`, `dask worker --tls-... --resources ...`, the
driver's certificate in its Dask config): it finishes and equals the embedded cluster's run bit
for bit, and a client without a certificate signed by the run's authority is refused: plain
TCP, TLS without a certificate, TLS with another authority's."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY_CLI_ITERATIONS, assert_same_runs

pytestmark = pytest.mark.slow

ITERATIONS = TINY_CLI_ITERATIONS  # the embedded run is the session's tiny_cli_run
OVERRIDES = [f"iterations={ITERATIONS}", "run_name=r", "--quiet"]
DASK = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
DASK_WORKER = [sys.executable, "-m", "distributed.cli.dask_worker"]


def _certificates(folder: Path, name: str) -> dict[str, Path]:
    """A certificate authority's cert and a key + cert it signed for 127.0.0.1, as PEM files."""
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
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    paths = {"ca": folder / f"{name}-ca.pem", "cert": folder / f"{name}.pem", "key": folder / f"{name}.key"}
    paths["ca"].write_bytes(cert(f"{name} CA", ca_key, f"{name} CA", ca_key, True).public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert("grpoflow", key, f"{name} CA", ca_key, False).public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


def _tls_args(p: dict[str, Path]) -> list[str]:
    return ["--tls-ca-file", str(p["ca"]), "--tls-cert", str(p["cert"]), "--tls-key", str(p["key"])]


def _tls_env(p: dict[str, Path]) -> dict[str, str]:
    return {"DASK_DISTRIBUTED__COMM__TLS__CA_FILE": str(p["ca"]),
            "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT": str(p["cert"]),
            "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY": str(p["key"]),
            "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True"}


def _grpoflow(runs_dir: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", f"runs_dir={runs_dir}",
                           *OVERRIDES, *extra], env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def tls_cluster(tmp_path):
    """(scheduler address, the run's certificate files, the environment its processes share)."""
    certs = _certificates(tmp_path, "run")
    env = {**os.environ, "GRPOFLOW_CACHE": str(tmp_path / "cache"), "PYTHONPATH": os.getcwd(),
           "GLOO_SOCKET_IFNAME": "lo", "DASK_LOGGING__DISTRIBUTED": "warning"}
    scheduler_file = tmp_path / "scheduler.json"
    procs = [subprocess.Popen([*DASK, "--protocol", "tls", "--host", "127.0.0.1", "--port", "0",
                               "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file),
                               *_tls_args(certs)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)]
    try:
        deadline, address = time.time() + 60, None
        while address is None:
            assert procs[0].poll() is None and time.time() < deadline, "the TLS scheduler did not start"
            try:
                address = json.loads(scheduler_file.read_text())["address"]
            except (OSError, ValueError, KeyError):  # not written yet, or half written
                time.sleep(0.2)
        assert address.startswith("tls://127.0.0.1:")
        # The tiny config's layout: two training ranks that hold the two rollout engines, one plain worker.
        for name, resources in (("train-0", "train=1,rollout=1"), ("train-1", "train=1,rollout=1"), ("plain-0", "")):
            procs.append(subprocess.Popen(
                [*DASK_WORKER, address, "--name", name, "--nthreads", "1", "--memory-limit", "0",
                 "--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0",
                 *(["--resources", resources] if resources else []), *_tls_args(certs)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        yield address, certs, env
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_a_tls_cluster_runs_the_same_run_and_refuses_strangers(tmp_path, tls_cluster, tiny_cli_run):
    address, certs, env = tls_cluster
    on_tls = _grpoflow(tmp_path / "tls", {**env, **_tls_env(certs)}, f"cluster.scheduler_address={address}")
    assert on_tls.returncode == 0, on_tls.stderr[-3000:]
    assert_same_runs(tiny_cli_run, tmp_path / "tls" / "r", ITERATIONS, min_weight_files=2 * ITERATIONS)

    # A TLS client that trusts the scheduler but shows no certificate: the handshake is refused
    # (TLS 1.3 reports it at the client's first read).
    host, port = address.removeprefix("tls://").rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(certs["ca"]))
    context.check_hostname = False
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        with pytest.raises((ssl.SSLError, ConnectionResetError)):
            with context.wrap_socket(raw) as tls:
                tls.recv(1)
    # Dask clients: plain TCP, and TLS with a certificate of another authority.
    other = _certificates(tmp_path, "other")
    probe = ("import sys\nfrom distributed import Client\n"
             "try:\n    Client(sys.argv[1], timeout='5s').close()\nexcept Exception as exc:\n"
             "    print('refused', type(exc).__name__)\nelse:\n    print('connected')\n")
    strangers = {"tcp": (address.replace("tls://", "tcp://"), {}), "another authority": (address, _tls_env(other))}
    for who, (addr, extra) in strangers.items():
        out = subprocess.run([sys.executable, "-c", probe, addr], env={**env, **extra}, capture_output=True,
                             text=True, timeout=120)
        assert out.stdout.startswith("refused"), f"{who}: {out.stdout} {out.stderr[-1500:]}"
    # ... and the run's own certificate does connect (the refusals above are not a dead scheduler).
    out = subprocess.run([sys.executable, "-c", probe, address], env={**env, **_tls_env(certs)},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("connected"), out.stderr[-1500:]
