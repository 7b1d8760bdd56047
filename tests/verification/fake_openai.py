"""A stand-in for `vllm serve` on loopback, for vLLM's own `vllm bench serve` client.

It streams completions the way vLLM's OpenAI server does (SSE chunks, then a
usage chunk, then [DONE]), exposes the spec-decode counters on /metrics in
Prometheus text, and accepts /start_profile and /stop_profile. Each request
counts as `drafts` draft steps of which `accepted` tokens per step were
accepted, so the client's acceptance length is 1 + accepted.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path

NUM_SPECULATIVE_TOKENS = 5


class FakeVllmServer:
    def __init__(self, model: str, accepted_per_draft: float = 2.5) -> None:
        self.model = model
        self.accepted_per_draft = accepted_per_draft
        self.calls: list[str] = []
        self.drafts = self.accepted = 0
        self._lock = threading.Lock()
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def __enter__(self) -> FakeVllmServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def metrics(self) -> str:
        labels = f'{{engine="0",model_name="{self.model}"}}'
        lines = [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            f"vllm:spec_decode_num_drafts_total{labels} {float(self.drafts)}",
            f"vllm:spec_decode_num_draft_tokens_total{labels} "
            f"{float(self.drafts * NUM_SPECULATIVE_TOKENS)}",
            f"vllm:spec_decode_num_accepted_tokens_total{labels} {float(self.accepted)}",
        ]
        for pos in range(NUM_SPECULATIVE_TOKENS):
            share = max(0.0, min(1.0, self.accepted_per_draft - pos))
            lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",'
                         f'model_name="{self.model}",position="{pos}"}} '
                         f"{float(int(self.drafts * share))}")
        return "\n".join(lines) + "\n"

    def _handler(self):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                server.calls.append(f"GET {self.path}")
                if self.path == "/metrics":
                    self._send(200, server.metrics().encode(), "text/plain")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps({"object": "list", "data": [
                        {"id": server.model, "object": "model"}]}).encode(),
                        "application/json")
                else:
                    self._send(200, b"", "text/plain")

            def do_POST(self):
                server.calls.append(f"POST {self.path}")
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path != "/v1/completions":
                    self._send(200, b"{}", "application/json")
                    return
                n = int(body.get("max_tokens", 16))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(n):
                    chunk = {"id": "cmpl-fake", "object": "text_completion",
                             "created": int(time.time()), "model": server.model,
                             "choices": [{"index": 0, "text": f" w{i % 50}", "logprobs": None,
                                          "finish_reason": "length" if i == n - 1 else None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.001)
                usage = {"id": "cmpl-fake", "object": "text_completion", "choices": [],
                         "usage": {"prompt_tokens": 32, "completion_tokens": n,
                                   "total_tokens": 32 + n}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
                with server._lock:
                    steps = max(1, round(n / (1 + server.accepted_per_draft)))
                    server.drafts += steps
                    server.accepted += round(steps * server.accepted_per_draft)

        return Handler


def word_level_tokenizer(folder: Path, words: int = 500) -> Path:
    """A tiny Hugging Face tokenizer on disk (whitespace-separated words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(words)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return folder
