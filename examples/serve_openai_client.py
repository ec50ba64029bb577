"""Serve a saved LLaMA with `devmap serve` and talk to it with the official openai client.

    python examples/serve_openai_client.py --out /tmp/models            # llama-tiny on the CPU
    python examples/serve_openai_client.py --out /tmp/models --model tinyllama-1.1b --device-map balanced

Saves the preset (random weights plus devmap's offline tokenizer) under OUT, starts the server on a free
local port, asks a completion, a streamed chat answer and the metrics, then stops the server (SIGTERM).
"""

import argparse
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

import devmap

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", required=True, help="model root: the checkpoint is written to OUT/MODEL")
parser.add_argument("--model", default="llama-tiny")
parser.add_argument("--device-map", default="auto")
args = parser.parse_args()

root = Path(args.out)
if not (root / args.model).exists():
    devmap.save(args.model, root / args.model)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = subprocess.Popen([sys.executable, "-m", "devmap", "serve", str(root / args.model), "--model-root",
                           str(root), "--device-map", args.device_map, "--port", str(port), "--log-level", "warning"])
try:
    for _ in range(600):  # wait for the model to load
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-needed-on-loopback")
    done = client.completions.create(model=args.model, prompt="The quick brown fox", max_tokens=12, temperature=0)
    print("completion:", repr(done.choices[0].text), done.usage)
    stream = client.chat.completions.create(model=args.model, messages=[{"role": "user", "content": "Hello!"}],
                                            max_tokens=12, temperature=0, stream=True)
    print("chat, streamed:", repr("".join(chunk.choices[0].delta.content or "" for chunk in stream)))
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    print("\n".join(line for line in metrics.splitlines() if line.startswith("devmap_completion_tokens_total")))
finally:
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=60)
