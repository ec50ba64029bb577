"""`ProcessCore`, the API's end of the pipes to the engine core's process, over pipes this test plays the core on: a
request sent after the core's process ended is refused with the reason the core gave as it ended, even when the
pipe breaks before the API's reader has read that reason."""

import threading
import time
from multiprocessing import Pipe

import pytest

from devmap.serving import GenerationParams
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
