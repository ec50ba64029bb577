"""Requests joining a continuous batch inside its decode steps (mixed batches, as vLLM schedules them): a step's rows
and a pack of joiners' prompts go through every product of a layer together (`CausalLMStages.mixed`), so the weights
are read once for both, and the rows never stop for a prefill of their own.

A decode step of a large model's few dozen rows is bound by reading its weights: its products run far below the GPU's
arithmetic pace, and a few hundred prompt tokens more cost little beside them. A prefill of its own reads every
weight again and holds up every row while it runs. Joiners take their rows at once (no one else gets them) and wait
in the batch's queue; each lane's step carries its queued prompts, oldest first, up to `riding_tokens` tokens (one
prompt at least; more while its steps run eager beside a compile), in a pack of its own. A prompt's keys and values
go into its row's columns right before the next step's slot, and its first token comes out of the step beside the
rows' next ones.

Used when every decoder layer is joined (`joined_projections`: devmap runs those layers itself) and the model is large
enough for it to pay and not 4-bit (`rides_by_default`), or when asked; other batches join through prefills of their
own (`join_prefill`).
"""

from __future__ import annotations

import contextlib
import threading
from functools import partial
from itertools import accumulate
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..pipelining.streams import scatter_later, to_host
from ..kernels.four_bit_linear import FourBitLinear
from .graphed_step import captures_are_paused
from .packs import Packs, onto
from .joins import JoinShape, on_device, pack_widths, prompt_columns, repeated, reused_width, to_device
from .lane_decode import computed_rows
from .row_types import SlotRequest

RIDING_TOKENS = 512  # prompt tokens one lane's step carries at most (one prompt at least): at 13B on an H200 the
# products of 32 rows plus 512 prompt tokens are bound by arithmetic (19 ms against 6.7 ms for the rows alone,
# benchmarks/probes/product_rows.py); more would only lengthen the rows' steps while a wave of joiners comes in

BESIDE_RIDING_TOKENS = 2048  # prompt tokens one lane's eager step carries at most while a compile runs beside serving
# (`compiling_beside`; captures paused, or the model's steps compiling in a process of their own): its steps then
# mostly run uncaptured (captures paused, or a pack width's first use), bound by the host's issuing of every layer's
# kernels, and a step carrying a pack limit's prompts costs about what one carrying RIDING_TOKENS does: a wave of
# joiners gets its first tokens in a quarter of the steps (docs/serving.md, "Measurements behind the defaults")

_compiles_beside = 0  # `compiling_beside` blocks open now, in any thread
_beside_lock = threading.Lock()

RIDING_MIN_PARAMETERS = 10_000_000_000  # by default steps carry prompts for models this large: where a decode step
# is bound by reading the weights, the host's extra work for a riding step hides behind it: a 13B LLaMA served more
# tokens riding, a 1.1B one fewer (its steps are bound by the host, which a riding step keeps longer; docs/serving.md
# has the runs). Sizes between are not measured: they join apart.
# Models with 4-bit projections (`FourBitLinear`) join apart at every size: past 128 rows, where a step's rows and a
# pack meet, 4-bit products take longer than bf16's, and a 13B int4 model served more tokens joining apart than
# riding (docs/serving.md, docs/quantization.md).

Rider = tuple[SlotRequest, int]  # a joiner carried by a step: its request and its row of the lane


def decoder_parameters(config: Any) -> int:
    """The parameters a decode step reads (every decoder layer's projections and the output head) of a LLaMA-shaped
    `config`, counted from its sizes (whatever the weights' format)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * config.intermediate_size
    return config.num_hidden_layers * layer + config.vocab_size * hidden


@contextlib.contextmanager
def compiling_beside() -> Iterator[None]:
    """Inside (any thread, nested or overlapping), a model's steps compile beside serving: batches whose steps are
    eager carry up to BESIDE_RIDING_TOKENS a step."""
    global _compiles_beside
    with _beside_lock:
        _compiles_beside += 1
    try:
        yield
    finally:
        with _beside_lock:
            _compiles_beside -= 1


def rides_by_default(model: nn.Module) -> bool:
    """Whether a continuous batch's steps carry joiners' prompts when nobody says: a model of at least
    RIDING_MIN_PARAMETERS whose projections are not 4-bit (see RIDING_MIN_PARAMETERS)."""
    if any(isinstance(module, FourBitLinear) for module in model.modules()):
        return False
    return decoder_parameters(model.config) >= RIDING_MIN_PARAMETERS


class Riding:
    """How a `ContinuousBatch` whose steps carry prompts takes joiners (`batch`: its rows, lanes and sampling;
    `packs`: its packed prompts): each takes its row at once and waits in `queued` until a step carries it."""

    def __init__(self, batch: Any, packs: Packs) -> None:
        self.batch, self.packs = batch, packs
        self.queued: list[tuple[SlotRequest, int, int]] = []  # (request, lane, row) of joiners waiting to ride

    def take(self, joining: list[tuple[SlotRequest, int, int]], step: int, slot: int) -> dict[int, list[Rider]]:
        """Reserve the joiners' rows (`reserve`); the queued joiners this step carries, per lane (`riders`)."""
        self.reserve(joining)
        return self.riders()

    def waiting(self) -> list[Any]:
        """Owners holding a row whose prompt waits for a step to carry it."""
        return [request.owner for request, _, _ in self.queued]

    def drop(self, owner: Any) -> None:
        """`owner` needs no more tokens: it leaves the queue."""
        self.queued = [item for item in self.queued if item[0].owner is not owner]

    @property
    def riding_tokens(self) -> int:
        """The most prompt tokens one lane's step carries (within a pack's limit; a longer prompt rides alone): more
        while the batch's steps are eager and a compile runs beside them (`compiling_beside`) or captures are paused
        (BESIDE_RIDING_TOKENS), read at each step."""
        beside = _compiles_beside > 0 or captures_are_paused()
        return min(BESIDE_RIDING_TOKENS if beside and not self.batch.run.compile else RIDING_TOKENS, self.packs.limit)

    def reserve(self, joining: list[tuple[SlotRequest, int, int]]) -> None:
        """Each (request, lane, row) takes its row now and waits in the queue for a step to carry its prompt."""
        for request, _, _ in joining:
            self.batch.check(request)
        for request, k, row in joining:
            held = self.batch.rows[k][row]
            held.issued_to, held.to_issue, held.queued = request.owner, request.max_new_tokens, True
            self.queued.append((request, k, row))

    def riders(self) -> dict[int, list[Rider]]:
        """The queued joiners this step carries, per lane: each lane's oldest, and its next ones while their prompts
        add up to at most `riding_tokens`. Each lane's step carries its own pack: a batch of S lanes over S stages takes
        in S times the prompt tokens of one lane per step, as its rows are S times one lane's."""
        tokens: dict[int, int] = {}
        full: set[int] = set()
        per_lane: dict[int, list[Rider]] = {}
        left = []
        budget = self.riding_tokens
        for request, k, row in self.queued:
            length = len(request.prompt)
            if k in full or (k in tokens and tokens[k] + length > budget):
                full.add(k)  # its later joiners wait for the next step, behind this one
                left.append((request, k, row))
                continue
            tokens[k] = tokens.get(k, 0) + length
            self.batch.rows[k][row].queued = False
            per_lane.setdefault(k, []).append((request, row))
        self.queued = left
        return per_lane

    def ride(self, k: int, riders: list[Rider], rows: int,
             slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Lane k's decode step over its first `rows` rows (writing cache slot `slot`) carrying the riders' prompts in
        one pack: their keys and values go into their rows' columns before slot + 1, where their rows decode from.
        Returns the rows' float logits, the riders' first tokens and what goes to the host for them (`pick`), on the
        last stage's stream."""
        run, lane, last = self.batch.run, self.batch.run.lanes[k], len(self.batch.s.stages) - 1
        counts, joined_rows = [len(request.prompt) for request, _ in riders], [row for _, row in riders]
        lengths, joined, total = torch.tensor(counts), torch.tensor(joined_rows), sum(counts)
        width = reused_width(total, self.packs.limit, lambda w: ("mixed", rows, w) in lane.row_steps)
        token_rows, columns = repeated(joined_rows, counts), prompt_columns(counts, slot + 1, self.batch.cache_len)
        ids, context, ready = self.packs.inputs([request.prompt for request, _ in riders], width)

        def into_rows(j: int, device: torch.device) -> None:
            lane.caches[j].take_prompts(self.packs.scratch(j), 0, total, to_device(token_rows, device),
                                        to_device(columns, device))
            lane.inputs[j].join(to_device(joined, device), to_device(lengths, device), slot + 1)

        logits, packed = self._carrying(k, rows, width, ids, context, ready, into_rows)
        with run.on(last):
            ends = on_device([end - 1 for end in accumulate(counts)], packed.device)  # each prompt's last token
            first, payload = self.batch.pick(self.batch.s.head(packed.index_select(0, ends)[:, None])[:, -1].float())
        return logits, first, payload

    def hand_in(self, k: int, riders: list[Rider], first: torch.Tensor, payload: torch.Tensor, step: int) -> None:
        """The riders' first tokens: to the host (`payload`: they reach their owners with the step's), and into their
        rows' inputs for the lane's next step, after the rows' own tokens got there."""
        run, lane = self.batch.run, self.batch.run.lanes[k]
        with run.on(len(self.batch.s.stages) - 1) as compute:
            host = to_host(payload)
            event = run.record(compute)
        joined = [(row, request, i) for i, (request, row) in enumerate(riders)]
        self.batch.pending[k].append((step, event, host, joined))
        # on stage 0's receive stream after the rows' own tokens: its compute stream goes on with the other lanes'
        # steps meanwhile (waiting there for this lane's last stage serialized the GPUs)
        lane.token_ready = scatter_later(lane.steps[0].static_in.view(-1), [row for _, row in riders], first, event,
                                         0, run.streams, after=lane.token_ready)
        self.batch.count_issued(k, [row for _, row in riders])  # the first token

    def shapes(self) -> list[JoinShape]:
        """The join shapes this batch's lanes made steps for so far: (rows computed, pack width) of each step carrying
        a pack (steps kept for the batch's shape count too)."""
        return sorted({(key[1], key[2]) for lane in self.batch.run.lanes for key in lane.row_steps
                       if isinstance(key, tuple) and key[0] == "mixed"})

    def capture(self, shapes: Sequence[JoinShape] | None = None) -> None:
        """Capture every lane's steps carrying a pack of each width up to `riding_tokens`, for every row count a step
        computes, before the batch's first step (on GPUs): a shape's first use otherwise costs an eager run and a
        capture in the middle of a burst of requests. `shapes`: only those (rows, width) among them (the shapes an
        earlier batch met, `shapes()`). The steps run on vacant rows with packs of one token per segment; the batch
        resets its rows and slots afterwards. Each runs `runs_before_serving` times."""
        wanted = None if shapes is None else {tuple(shape) for shape in shapes}
        for k, lane in enumerate(self.batch.run.lanes):
            lane_rows = lane.ids.shape[0]
            for rows in sorted({computed_rows(highest, lane_rows) for highest in range(-1, lane_rows)}):
                for width in pack_widths(self.packs.limit):
                    if width > max(self.riding_tokens, 64):
                        break
                    if ("mixed", rows, width) in lane.row_steps or (wanted is not None and (rows, width) not in wanted):
                        continue
                    ids, context, ready = self.packs.inputs([[0]] * width, width)
                    for _ in range(self.batch.run.runs_before_serving):
                        self._carrying(k, rows, width, ids, context, ready)

    def _carrying(self, k: int, rows: int, width: int, ids: torch.Tensor, context: dict, ready: Any,
                  after: Callable[[int, torch.device], None] | None = None) -> Any:
        """Lane k's step over its first `rows` rows carrying a pack of `width` tokens (ids, and its mask and positions
        ready at `ready`) on every stage (`after(j, device)` once stage j's is issued); the last stage's output."""
        run, lane, last = self.batch.run, self.batch.run.lanes[k], len(self.batch.s.stages) - 1
        scratches = [self.packs.scratch(j) for j in range(last + 1)]
        steps = run.decode.mixed_steps(lane, rows, width, scratches, self.packs.cache)
        out = event = None
        for j, stage in enumerate(self.batch.s.stages):
            step, positions, mask = steps[j]
            with run.on(j) as compute:
                move = partial(onto, device=stage.device, j=j, streams=run.streams, compute=compute)
                if j == 0:
                    if compute is not None and lane.token_ready is not None:  # the rows' tokens are in place
                        compute.wait_event(lane.token_ready)
                    step.static_in.copy_(ids.view(-1))
                else:
                    step.static_in.copy_(move(out, event))
                positions.copy_(move(context["position_ids"], ready))
                mask.copy_(move(context["attention_mask"], ready))
                with run.clock.around(j, compute):
                    out = step.handed_on(step(), j < last)
                    if after is not None:
                        after(j, stage.device)
                event = run.record(compute)
        return out
