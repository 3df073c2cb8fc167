"""README.md's quick start, as a newcomer runs it against the real server: the ready line its
log shows, the curl call and the openai-client call, each as written but for the address."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

from tests.helpers.e2e_server import Server

README = Path(__file__).resolve().parents[1] / "README.md"
ADDRESS = "localhost:8080"


def _block(language: str, containing: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)
    (block,) = [b for b in blocks if containing in b]
    return block


def test_the_ready_line_is_what_the_server_logs(server: Server) -> None:
    said = re.search(r"the log says `(.*?)\.\.\.s`", README.read_text()).group(1)
    assert said in server.log()


def test_the_curl_call_answers(server: Server) -> None:
    command = _block("bash", "curl ").replace("\\\n", " ").replace(ADDRESS, server.http_host)
    proc = subprocess.run(shlex.split(command) + ["-sf"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["model"] == "smol" and body["choices"][0]["message"]["content"].strip()


def test_the_openai_client_call_prints_a_reply(server: Server, capsys) -> None:
    code = _block("python", "from openai import OpenAI")
    assert f"http://{ADDRESS}" in code
    exec(compile(code.replace(f"http://{ADDRESS}", server.url), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()
