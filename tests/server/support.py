"""Helpers for the server tests (no tests here): a real `kiln serve` process on a free loopback port,
raw HTTP, and a tiny hand-built model that calls a tool.

The tool model is a one-layer llama whose weights are written by hand so that its greedy answers are
known: after a chat prompt it calls `get_weather` in the Hermes format; once the prompt holds a
<tool_response> it answers "It is sunny in Paris."; any other text continues as "!!!!..." for as long
as it is allowed to (a generation that never ends by itself). Its one attention head raises a flag
when a <tool_response> token is anywhere in the context; the LM head reads the current token and that
flag.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]     # the repository: `kiln serve` runs from there


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`kiln serve ARGS --port P` in a child process; stderr goes to a file (it can be long)."""

    def __init__(self, *args: str, env: dict | None = None, host: str = "127.0.0.1"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="kiln-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "kiln.cli", "serve", *args, "--host", host, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT,
                                     env={**os.environ, **(env or {})})

    def wait(self, timeout: float = 240) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}: {self.stderr()}")
            try:
                if request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"kiln serve did not come up in {timeout} s: {self.stderr()}")

    def stderr(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)


def request(port: int, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 120):
    """Raw HTTP: (status, parsed JSON or raw text). `body` may be bytes, str, or an object sent as JSON."""
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read().decode("utf-8")
    finally:
        conn.close()
    try:
        return resp.status, json.loads(data)
    except ValueError:
        return resp.status, data


def wait_health(port: int, ok, timeout: float = 30) -> dict:
    """Poll /health until `ok(health)`; the last health seen."""
    deadline = time.monotonic() + timeout
    while True:
        health = request(port, "GET", "/health")[1]
        if ok(health) or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def assert_openai_error(body) -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    return err


# ------------------------------------------------------------------------------------------------
# The tool-calling model

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ANSWER = "It is sunny in Paris."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

# Hermes-style (Qwen 2.5) chat template: tools in the system turn, calls in <tool_call>, results
# in <tool_response> inside a user turn.
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\nYou may call these functions:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}"
    """{{- '\n</tools>\nCall one as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n' }}"""
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant\n' }}"
    "{%- for call in message.tool_calls %}"
    "{{- '<tool_call>\n' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson"
    " + '\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def _byte_vocab() -> dict[str, int]:
    """GPT-2's byte alphabet, printable bytes first (so id 0 is "!")."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(rest)}
    return {chars[b]: i for i, b in enumerate(printable + rest)}


def _tokenizer(path: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(t, normalized=False)
                    for t in ("<tool_call>\n", "\n</tool_call>", "<tool_response>", CALL, ANSWER)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}))
    return tok


def build_tool_model(path: Path, template: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(path)
    if not template:
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    V = tok.get_vocab_size(with_added_tokens=True)
    flag, H, D = V, (V + 8) // 8 * 8, 8                     # hidden: one dim per token, then the flag
    ids = {t: tok.token_to_id(t) for t in ("<tool_call>\n", "\n</tool_call>", "<tool_response>", CALL, ANSWER,
                                           "<|im_end|>", "\u010a", "!")}   # \u010a: the byte "\n"
    tco, tcc, tr, call, ans, end, nl, bang = ids.values()
    emb = torch.zeros(V, H)
    emb[torch.arange(V), torch.arange(V)] = 1.0             # token i -> unit vector i
    q, k, v, o = torch.zeros(D, H), torch.zeros(D, H), torch.zeros(D, H), torch.zeros(H, D)
    q[D - 1, :] = 1.0       # every position asks one question (in the slowest RoPE pair: no rotation) ...
    k[D - 1, tr] = 1.0      # ... that only <tool_response> answers, with a score of ~H/sqrt(D)
    v[0, tr] = 1.0
    o[flag, 0] = 1.5 / H ** 0.5                             # flag = 1.5 after a tool response, else 0
    head = torch.zeros(V, H)
    head[bang, :V] = 0.5                                    # by default: "!"
    for a, b in ((nl, tco), (tco, call), (call, tcc), (tcc, end), (ans, end)):
        head[b, a] = 2.0                                    # the call, token by token
    head[ans, nl], head[ans, flag] = 1.0, 1.0               # with the flag up, the answer wins after "\n"
    head *= 10  # margins of ~45 logits: even sampled at temperature 1 the answers above are certain
    layer = "model.layers.0."
    weights = {
        "model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(H), "lm_head.weight": head,
        layer + "input_layernorm.weight": torch.ones(H), layer + "post_attention_layernorm.weight": torch.ones(H),
        layer + "self_attn.q_proj.weight": q, layer + "self_attn.k_proj.weight": k,
        layer + "self_attn.v_proj.weight": v, layer + "self_attn.o_proj.weight": o,
        layer + "mlp.gate_proj.weight": torch.zeros(8, H), layer + "mlp.up_proj.weight": torch.zeros(8, H),
        layer + "mlp.down_proj.weight": torch.zeros(H, 8),
    }
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "num_hidden_layers": 1,
        "intermediate_size": 8, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": D,
        "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": 1e24, "max_position_embeddings": 65536,
        "tie_word_embeddings": False, "eos_token_id": end}))
    return path
