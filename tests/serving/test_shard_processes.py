"""Rank 0's side of a split service (`ShardProcesses`) when a shard process ends: whichever call hears of it first,
the split ends once, and the reason names the process and its exit code."""

import multiprocessing
import sys

import pytest

from devmap.serving import shards
from devmap.serving.errors import EngineGone
from devmap.serving.shard_start import StartedShards


def _exits(code: int) -> None:
    sys.exit(code)


@pytest.fixture
def ended_shard(monkeypatch):
    """A split of two whose shard process has exited with code 3, before the watchdog could hear of it."""
    monkeypatch.setattr(shards, "join_group", lambda *args: None)
    monkeypatch.setattr(shards.ShardProcesses, "_watch", lambda self: None)
    context = multiprocessing.get_context("spawn")
    reads, writes = context.Pipe(duplex=False)
    replies, answers = context.Pipe(duplex=False)
    heard, said = context.Pipe(duplex=False)
    process = context.Process(target=_exits, args=(3,))
    process.start()
    for end in (reads, answers, said):
        end.close()
    process.join(30)
    failures = []
    split = shards.ShardProcesses(StartedShards(2, "tcp://unused", [process], [writes], [replies], [heard]),
                                  failures.append)
    yield split, failures
    split.close()


def test_a_call_sent_to_an_ended_shard_process_names_it(ended_shard):
    split, failures = ended_shard
    with pytest.raises(EngineGone, match=r"shard process 1 of 2 ended \(exit code 3\)"):
        split.send("step", [])
    assert failures == [split.failure]
    with pytest.raises(EngineGone, match="shard process 1 of 2 ended"):  # and every call after it
        split.send("collect", False)
    assert len(failures) == 1


def test_waiting_for_an_ended_shard_process_s_answer_names_it(ended_shard):
    split, failures = ended_shard
    with pytest.raises(EngineGone, match=r"shard process 1 of 2 ended \(exit code 3\).*restart the service"):
        split.agree(True, "loading tiny")
    assert len(failures) == 1
