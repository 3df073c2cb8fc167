"""bench/compare.py's llama.cpp peer (bench/peers/llamacpp.py) driven against a stand-in
`llama-server`: a stdlib HTTP server that takes llama-server's flags, answers /health and streams
OpenAI completions. What is checked is our side: the flags each dtype's run passes, one slot per
request offline, token accounting, and that a server which stops at EOS is refused, not
measured. No model, no llama.cpp build."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import compare  # noqa: E402
from peers import llamacpp  # noqa: E402

STAND_IN = '''#!{python}
import argparse, json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
ap = argparse.ArgumentParser()
for flag in ("-m", "--host", "--port", "--alias", "--threads", "--parallel", "--ctx-size"):
    ap.add_argument(flag)
args = ap.parse_args()
open(args.m + ".argv", "w").write(json.dumps(sys.argv[1:]))
STOP_AT = int(open(args.m).read() or 0)  # 0: honour ignore_eos; N: "EOS" after N tokens
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0"); self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == args.alias and body["temperature"] == 0.0
        assert body["ignore_eos"] is True and body["stream"] is True
        n = min(body["max_tokens"], STOP_AT) if STOP_AT else body["max_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
        def chunk(obj):
            data = ("data: " + json.dumps(obj) + "\\n\\n").encode()
            self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))
        for _ in range(n):
            chunk({{"choices": [{{"text": "x", "index": 0}}]}})
        chunk({{"choices": [], "usage": {{"prompt_tokens": len(body["prompt"]),
                                          "completion_tokens": n}}}})
        self.wfile.write(b"0\\r\\n\\r\\n")
ThreadingHTTPServer((args.host, int(args.port)), H).serve_forever()
'''


@pytest.fixture
def peer_dir(tmp_path: Path) -> Path:
    exe = tmp_path / "llama-server"
    exe.write_text(STAND_IN.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "smollm2-q4_1.gguf").write_text("")
    return tmp_path


def test_each_dtype_maps_to_the_file_a_llamacpp_user_runs(peer_dir: Path) -> None:
    assert llamacpp.gguf_for(peer_dir, "default").name == "smollm2-q4_1.gguf"
    assert llamacpp.gguf_for(peer_dir, "gguf").name == "smollm2-q4_1.gguf"
    assert llamacpp.gguf_for(peer_dir, "float32") is None  # the F32 file was not made here
    assert llamacpp.gguf_for(peer_dir, "bfloat16") is None  # no counterpart at all
    args = compare.parse_args(["--peers", "llamacpp,vllm", "--dtypes", "gguf,float32",
                               "--llamacpp-dir", str(peer_dir)])
    assert compare.runs_at(compare.US, "gguf", args)
    assert compare.runs_at("llamacpp", "gguf", args)
    assert not compare.runs_at("llamacpp", "float32", args)
    assert not compare.runs_at("vllm", "gguf", args)
    assert compare.runs_at("vllm", "float32", args)


def test_offline_gives_every_request_a_slot_and_counts_its_tokens(peer_dir: Path,
                                                                   tmp_path: Path) -> None:
    gguf = peer_dir / "smollm2-q4_1.gguf"
    res = llamacpp.offline(peer_dir, gguf, "random", 6, 5, "smol", 2, tmp_path / "log",
                           ready_timeout=60)
    argv = (peer_dir / "smollm2-q4_1.gguf.argv").read_text()
    assert '"--parallel", "6"' in argv and f'"--ctx-size", "{6 * llamacpp.CTX_PER_SLOT}"' in argv
    assert '"--threads", "2"' in argv and '"--alias", "smol"' in argv
    run = res["runs"][0]
    assert res["slots"] == 6 and res["gguf"] == gguf.name
    assert run["output_tokens"] == 6 * 5
    assert run["output_tok_s"] == pytest.approx(run["output_tokens"] / run["seconds"])


def test_a_server_that_stops_at_eos_is_refused_not_measured(peer_dir: Path,
                                                            tmp_path: Path) -> None:
    gguf = peer_dir / "smollm2-q4_1.gguf"
    gguf.write_text("3")  # the stand-in stops every request after 3 tokens
    with pytest.raises(RuntimeError, match="EOS was not ignored"):
        llamacpp.offline(peer_dir, gguf, "random", 2, 5, "smol", 2, tmp_path / "log",
                         ready_timeout=60)


def test_env_finds_the_peers_shared_libraries(peer_dir: Path) -> None:
    assert llamacpp.env(peer_dir)["LD_LIBRARY_PATH"].split(":")[0] == str(peer_dir)
    assert os.environ.get("LD_LIBRARY_PATH") != llamacpp.env(peer_dir)["LD_LIBRARY_PATH"]
