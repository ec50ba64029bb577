"""`ProcessCore`, the API's end of the pipes to the engine core's process, over pipes this test plays the core on: a
request sent after the core's process ended is refused with the reason the core gave as it ended, even when the
pipe breaks before the API's reader has read that reason; a tokenizer read ahead is the one a model's card gets."""

import threading
import time
from multiprocessing import Pipe

import pytest

from devmap.serving import GenerationParams, core_client
from devmap.serving.core_client import ProcessCore
from devmap.serving.core_parts import StartedCore
from devmap.serving.errors import EngineGone
from devmap.serving.jobs import Job


class EndedProcess:
    """The core's process, already ended (os._exit(1) after its last words)."""

    exitcode = 1
    sentinel = None

    def join(self, timeout=None) -> None:
        pass

    def is_alive(self) -> bool:
        return False

    def terminate(self) -> None:
        pass


def test_a_send_that_finds_the_core_gone_answers_with_the_reason_it_gave():
    to_core_out, to_core_in = Pipe(duplex=False)
    from_core_out, from_core_in = Pipe(duplex=False)
    client = ProcessCore(StartedCore(EndedProcess(), to_core_in, from_core_out))
    reading = threading.Event()
    lost = []

    def slow_deliver(outputs) -> None:  # the reader is busy with a step's outputs as the core's process ends
        reading.set()
        time.sleep(0.5)

    client.attach(slow_deliver, lost.append)
    from_core_in.send(("out", []))
    from_core_in.send(("failed", "shard process 1 of 2 ended (exit code -9): restart the service"))
    from_core_in.close()
    to_core_out.close()  # the core's end of the request pipe: sending to it now breaks
    assert reading.wait(5)
    with pytest.raises(EngineGone, match="shard process 1 of 2 ended"):
        client.add(Job(1, "tiny", [1, 2, 3], GenerationParams()))
    assert lost and "shard process 1 of 2 ended" in lost[0].message
    with pytest.raises(EngineGone, match="shard process 1 of 2 ended"):  # and every later request
        client.add(Job(2, "tiny", [1], GenerationParams()))


class RunningProcess(EndedProcess):
    exitcode = None

    def is_alive(self) -> bool:
        return True


def test_a_tokenizer_read_ahead_is_the_one_its_models_card_gets_and_is_read_once(model_root, monkeypatch):
    reads = []
    plain_read = core_client.load_tokenizer
    monkeypatch.setattr(core_client, "load_tokenizer", lambda path: reads.append(path) or plain_read(path))
    to_core_out, to_core_in = Pipe(duplex=False)
    from_core_out, from_core_in = Pipe(duplex=False)
    client = ProcessCore(StartedCore(RunningProcess(), to_core_in, from_core_out))
    path = (model_root / "tiny").resolve()

    def core() -> None:  # answers every describe call with the model loaded from `path`
        while True:
            message = to_core_out.recv()
            if message[0] == "close":
                from_core_in.send(("closed",))
                return
            kind, call_id, method, args = message
            assert (kind, method) == ("call", "describe")
            from_core_in.send(("reply", call_id, True, {"path": str(path), "context_length": 256, "vocab_size": 512}))

    playing = threading.Thread(target=core, daemon=True)
    playing.start()
    client.read_tokenizers([path])  # while the core loads the model
    assert reads == [path]
    card = client.card("tiny")
    assert reads == [path] and card.tokenizer("hello", add_special_tokens=False)["input_ids"]
    client.forget("tiny")  # unloaded, then loaded again from the same directory: read anew
    assert client.card("tiny").tokenizer is not card.tokenizer and reads == [path, path]
    client.close(timeout=5)
    playing.join(5)
