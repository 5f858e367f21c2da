"""gRPC over mutual TLS between every service: certificates made by the test with openssl."""
from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest

from mesh import Mesh, Router
from stagemesh.client import Client
from stagemesh.core.service_options import TLSConfig, channel_credentials
from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from tiny_models import with_word_tokenizer

pytestmark = pytest.mark.slow
KEY = "sekret"


def make_certs(folder) -> dict[str, str]:
    """A CA and one service certificate for 127.0.0.1 (server and client use), signed by it."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make test certificates")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=30)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=stagemesh-test-ca")
    run("req", *ec, "-keyout", "svc.key", "-out", "svc.csr", "-subj", "/CN=stagemesh")
    (folder / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                    "extendedKeyUsage=serverAuth,clientAuth\n")
    run("x509", "-req", "-in", "svc.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "svc.pem",
        "-days", "1", "-extfile", "ext.cnf")
    return {name: str(folder / f) for name, f in (("ca", "ca.pem"), ("cert", "svc.pem"), ("key", "svc.key"))}


@pytest.fixture(scope="module")
def tls_mesh(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    certs = make_certs(folder)
    flags = ("--tls-cert", certs["cert"], "--tls-key", certs["key"], "--tls-ca", certs["ca"])
    model = with_word_tokenizer(tiny_model_dir("llama"), folder / "model")
    read = {k: open(v, "rb").read() for k, v in certs.items()}
    creds = channel_credentials(TLSConfig(read["cert"], read["key"], read["ca"]))
    with Mesh(model, [2, 2], handoff="grpc", log_dir=folder, credentials=creds,
              scheduler_args=("--served-model-name", "m", *flags), stage_args=flags) as mesh:
        with Router(model, [mesh.address], log_dir=folder, grpc_frontend=True,
                    extra=(*flags, "--api-key", KEY)) as router:
            mesh.router, mesh.certs = router, certs
            yield mesh


def test_requests_flow_over_mutual_tls(tls_mesh):
    out = tls_mesh.router.client(api_key=KEY).completions.create(model="m", prompt="a b c", max_tokens=4, temperature=0,
                                                      extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4  # router -> scheduler -> stage 0 -> stage 1, all over TLS
    c = tls_mesh.certs
    done = Client(f"127.0.0.1:{tls_mesh.router.grpc_port}", tls_ca=c["ca"], tls_cert=c["cert"],
                  tls_key=c["key"], timeout=30, api_key=KEY).generate("a b c", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4 and done.finish_reason == "length"


def test_grpc_frontend_checks_the_api_key(tls_mesh):
    c = tls_mesh.certs
    for key in (None, "wrong"):
        client = Client(f"127.0.0.1:{tls_mesh.router.grpc_port}", tls_ca=c["ca"], tls_cert=c["cert"],
                        tls_key=c["key"], timeout=30, api_key=key)
        with pytest.raises(grpc.RpcError) as err:
            client.generate("a b c", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in err.value.details()


@pytest.mark.parametrize("how", ["plain text", "no client certificate"])
def test_a_client_without_the_right_credentials_is_refused(tls_mesh, how):
    c = tls_mesh.certs
    if how == "plain text":
        channel = grpc.insecure_channel(tls_mesh.address)
    else:
        channel = grpc.secure_channel(tls_mesh.address, grpc.ssl_channel_credentials(open(c["ca"], "rb").read()))
    with channel:
        with pytest.raises(grpc.RpcError) as err:
            scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_flags_are_checked(tmp_path):
    from stagemesh.core.errors import StagemeshError
    from stagemesh.core.service_options import configure_tls

    with pytest.raises(StagemeshError, match="--tls-cert and --tls-key go together"):
        configure_tls(str(tmp_path / "x.pem"), None, None)
    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(StagemeshError, match="not a PEM file"):
        configure_tls(None, None, str(tmp_path / "bad.pem"))
    with pytest.raises(StagemeshError, match="No such file"):
        configure_tls(None, None, str(tmp_path / "missing.pem"))
    configure_tls(None, None, None)
