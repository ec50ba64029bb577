"""Continuous batching on CPU, two stages: requests that join free rows mid-batch get the tokens of generating alone."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from devmap import generate
from devmap.errors import UsageError
from devmap.generation import joins, mixed_joins
from devmap.generation.continuous import SlotRequest, continuous_batch, generate_continuous
from devmap.generation.joined_projections import every_layer_joined, join_projections
from devmap.generation.sampling import Sampling


@pytest.fixture(scope="module", params=["own prefills", "riding joiners"])
def model(request, tiny_llama):
    """The tiny LLaMA as it is (joiners prefill on their own between steps), or with its projections joined (the
    decode steps carry joiners' prompts: `mixed_joins`); the same weights, so the same tokens."""
    torch.manual_seed(0)
    model = tiny_llama()
    if request.param == "riding joiners":
        assert join_projections(model) == 2 * model.config.num_hidden_layers
    return model


def alone(model, prompt, new, split=2):
    out = generate(model, torch.tensor([prompt]), max_new_tokens=new, split_layers=[split], eos_token_id=[])
    return out[0, len(prompt):].tolist()


def requests(count, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (count,), generator=g).tolist()
    news = torch.randint(1, 9, (count,), generator=g).tolist()
    return [SlotRequest(torch.randint(3, 512, (n,), generator=g).tolist(), m, f"r{i}")
            for i, (n, m) in enumerate(zip(lengths, news))]


@pytest.fixture
def run(run_continuous):
    """`run_continuous` on two CPU stages: the tokens each owner got, the owners left unfinished, the unstarted."""
    def on_two_stages(model, first, later, rows, first_slot=12, cache_len=40, lanes=2, **kwargs):
        return run_continuous(model, first, later, rows=rows, first_slot=first_slot, cache_len=cache_len,
                              lanes=lanes, split_layers=[2], **kwargs)
    return on_two_stages


@pytest.mark.parametrize("together", [True, False])
def test_joined_requests_get_the_tokens_of_generating_alone(model, run, together):
    """Joiners of different prompt lengths, several in one step over both lanes (one padded prefill), or one by one."""
    reqs = requests(14)
    got, left, queue = run(model, reqs[:3], reqs[3:], rows=6, together=together)
    assert not left and not queue
    for r in reqs:
        assert got[r.owner] == alone(model, r.prompt, r.max_new_tokens), r.owner


def test_a_lane_nobody_holds_sits_out_and_catches_up_when_a_request_joins_it(model):
    """Two lanes over two stages: while one request holds a row of lane 0, lane 1 issues nothing (its stage 0 step
    would delay lane 0's next one); a request joining lane 1 ten steps later decodes from the batch's slot, with the
    tokens of generating alone."""
    first, late = SlotRequest(list(range(3, 10)), 16, "first"), SlotRequest(list(range(20, 29)), 5, "late")
    got = {"first": [], "late": []}
    with continuous_batch(model, rows=2, first_slot=12, cache_len=40, lanes=2, split_layers=[2],
                          graphs=False) as batch:
        issued = []
        decode_step = batch.run.decode.decode_step
        batch.run.decode.decode_step = lambda lane, steps=None: issued.append(batch.run.lanes.index(lane)) or \
            decode_step(lane, steps)
        batch.step([first])
        for _ in range(9):
            batch.step([])
        assert issued[-9:] == [0] * 9 and batch.free_rows() == [(1, 0)]  # lane 1 sat out
        batch.step([late])
        while batch.step([]):
            for owner, token in batch.collect():
                got[owner].append(token)
                if len(got[owner]) == (16 if owner == "first" else 5):
                    batch.release(owner)
        for owner, token in batch.collect(everything=True):
            got[owner].append(token)
    assert 1 in issued
    for r in (first, late):
        assert got[r.owner][:r.max_new_tokens] == alone(model, r.prompt, r.max_new_tokens), r.owner


def test_joiners_keep_the_lanes_even(model):
    """Free rows come in the order joiners take them: the lane holding fewest rows first, the first of those on a tie
    (at equal rows the weight read is the same either way; even lanes overlap the stages' prefill work)."""
    with continuous_batch(model, rows=6, first_slot=12, cache_len=40, lanes=2, split_layers=[2],
                          graphs=False) as batch:
        assert batch.free_rows() == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
        batch.step([SlotRequest(list(range(3, 8)), 8, "a")])
        assert batch.free_rows() == [(1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
        batch.step([SlotRequest(list(range(3, 8)), 8, "b"), SlotRequest(list(range(9, 12)), 8, "c")])
        assert batch.free_rows() == [(1, 1), (0, 2), (1, 2)]


def test_free_rows_keep_any_lanes_even_and_list_every_free_row_once():
    """Whatever rows are held, taking the first n free rows in `free_rows`' order leaves the lanes as even as their
    free rows allow: each next row goes to a lane holding the fewest rows among those with a free one."""
    from types import SimpleNamespace

    from devmap.generation.continuous_rows import ContinuousBatch

    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
    @hypothesis.given(st.lists(st.lists(st.booleans(), min_size=1, max_size=8), min_size=1, max_size=4))
    def check(held):
        rows = [[SimpleNamespace(issued_to=object() if h else None) for h in lane] for lane in held]
        order = ContinuousBatch.free_rows(SimpleNamespace(rows=rows))
        assert sorted(order) == [(k, r) for k, lane in enumerate(held) for r, h in enumerate(lane) if not h]
        count = [sum(lane) for lane in held]
        free = [len(lane) - c for lane, c in zip(held, count)]
        for k, r in order:
            assert count[k] == min(count[j] for j in range(len(held)) if free[j])  # the emptiest lane with room
            count[k], free[k] = count[k] + 1, free[k] - 1
        for k in range(len(held)):  # within a lane, its lowest free rows first (decode steps compute a prefix)
            mine = [r for j, r in order if j == k]
            assert mine == sorted(mine)

    check()


def test_a_request_joins_while_others_still_decode(model, run):
    long = SlotRequest(list(range(3, 10)), 20, "long")
    short = SlotRequest(list(range(20, 24)), 2, "short")
    late = SlotRequest(list(range(40, 51)), 6, "late")  # longer prompt than `short`: its columns reach back
    got, left, _ = run(model, [long, short], [late], rows=2, lanes=1)
    assert not left
    for r in (long, short, late):
        assert got[r.owner] == alone(model, r.prompt, r.max_new_tokens), r.owner


def test_a_later_first_slot_lets_longer_prompts_join_at_once(model, run):
    """The lanes decode from slot 20: a joiner of 18 prompt tokens fits at once, beside short first prompts."""
    short = [SlotRequest([5, 6, 7], 1, "a"), SlotRequest([8, 9, 10, 11, 12, 13], 9, "b")]
    long = SlotRequest(list(range(100, 118)), 7, "long")
    got, left, queue = run(model, short, [long], rows=2, first_slot=20, cache_len=40)
    assert not left and not queue
    for r in (*short, long):
        assert got[r.owner] == alone(model, r.prompt, r.max_new_tokens), r.owner


def test_joiners_of_mixed_lengths_go_in_packs_and_get_their_own_tokens(model, run, monkeypatch):
    """One step's joiners of 3 to 150 tokens packed end to end, several packs in a step (PACK_TOKENS made small),
    their scratch caches sharing one arena, their columns wrapping around the cache's end."""
    monkeypatch.setattr(joins, "PACK_TOKENS", 200)
    g = torch.Generator().manual_seed(5)
    lengths = [3, 150, 40, 70, 9, 120, 64, 65, 20, 31, 5, 100]
    reqs = [SlotRequest(torch.randint(3, 512, (n,), generator=g).tolist(), 3 + i % 4, f"m{i}")
            for i, n in enumerate(lengths)]
    got, left, queue = run(model, reqs[:1], reqs[1:], rows=12, first_slot=160, cache_len=176)
    assert not left and not queue
    for r in reqs:
        assert got[r.owner] == alone(model, r.prompt, r.max_new_tokens), r.owner


def test_a_pack_keeps_each_prompt_to_its_own_tokens():
    """The mask of prompts of 3 and 2 tokens packed in 7: causal within each prompt, nothing across, padding
    tokens attending to themselves; positions from each prompt's start."""
    ids, segments, positions = joins.packed_prompts([[5, 6, 7], [8, 9]], 7)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 0, 0]] and positions.tolist() == [[0, 1, 2, 0, 1, 0, 0]]
    keep = joins.packed_context(segments, positions, None)["attention_mask"][0, 0].int().tolist()
    assert keep == [[1, 0, 0, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0, 0, 0],
                    [1, 1, 1, 0, 0, 0, 0],
                    [0, 0, 0, 1, 0, 0, 0],
                    [0, 0, 0, 1, 1, 0, 0],
                    [0, 0, 0, 0, 0, 1, 0],
                    [0, 0, 0, 0, 0, 0, 1]]
    additive = joins.packed_context(segments, positions, torch.float32)["attention_mask"][0, 0]
    assert torch.equal(additive == 0, torch.tensor(keep, dtype=torch.bool))
    # their keys go right before slot 11 of a 10-column cache (slot 1 once wrapped): the first prompt's around the end
    assert joins.prompt_columns([3, 2], 11, 10).tolist() == [8, 9, 0, 9, 0]
    assert joins.repeated([4, 7], [3, 2]).tolist() == [4, 4, 4, 7, 7] and joins.repeated([], []).dtype == torch.long


def test_every_join_shape_is_prepared_before_the_first_step_where_asked(model, run, monkeypatch):
    """With captured steps (here: the cached-step path on CPU, eager) and `every_shape` (a service's warm-up), a
    batch prepares the prefill of every pack width up front (or, where its steps carry the joiners, every lane's step
    of each row count and pack width within a step's prompt tokens), and joins still give each request its tokens."""
    from devmap.generation import lanes
    from devmap.generation.step_cache import release_graphs, step_cache

    monkeypatch.setattr(lanes, "graphs_possible", lambda devices: True)
    release_graphs(model)
    reqs = requests(8, seed=2)
    try:
        got, left, queue = run(model, reqs[:2], reqs[2:], rows=4, first_slot=12, cache_len=24, every_shape=True)
        entries = step_cache(model, "continuous").entries
        shapes = {key[1:] for key in entries if isinstance(key, tuple) and key[0] == "join"}
        riding = {(k, key[1:]) for k in range(2) for key in entries[("rows", k)] if key[0] == "mixed"}
    finally:
        release_graphs(model)
    widths = joins.pack_widths(joins.pack_limit(24, 4))  # 64 and 96: each lane has 2 rows
    if every_layer_joined(model):
        assert not shapes and riding == {(k, (2, width)) for k in range(2) for width in widths}
    else:
        assert shapes == {(width,) for width in widths} and not riding
    assert not left and not queue
    for r in reqs:
        assert got[r.owner] == alone(model, r.prompt, r.max_new_tokens), r.owner


@pytest.mark.parametrize("paused", [False, True])
def test_a_batch_prepares_only_the_join_shapes_it_meets(model, run, monkeypatch, paused):
    """By default a batch runs no join shape up front: each runs when a step needs it and captures at its second
    use, so a first wave of prompts pays for the shapes it meets only; so too while a compile runs beside serving
    (captures paused: run up front, they would all run eagerly before its first token). Its requests get their
    tokens."""
    from devmap.generation import lanes
    from devmap.generation.graphed_step import captures_paused
    from devmap.generation.step_cache import release_graphs, step_cache

    monkeypatch.setattr(lanes, "graphs_possible", lambda devices: True)
    release_graphs(model)
    reqs = requests(4, seed=3)
    try:
        with captures_paused() if paused else contextlib.nullcontext():
            got, left, queue = run(model, reqs[:2], reqs[2:], rows=4, first_slot=12, cache_len=24)
        entries = step_cache(model, "continuous").entries
        prepared = [key for key in entries if isinstance(key, tuple) and key[0] == "join"]
        prepared += [key for k in range(2) for key in entries.get(("rows", k), {}) if key[0] == "mixed"]
    finally:
        release_graphs(model)
    widths = joins.pack_widths(joins.pack_limit(24, 4))
    assert len(prepared) < len(widths) * (2 if every_layer_joined(model) else 1)  # only the widths joins used
    assert not left and not queue
    for r in reqs:
        assert got[r.owner] == alone(model, r.prompt, r.max_new_tokens), r.owner


def test_a_batch_makes_the_join_shapes_an_earlier_batch_met_before_its_first_step_where_asked(model, run,
                                                                                               monkeypatch):
    """A batch lists the join shapes its steps met (kept ones too: a later batch of its shape on the same model lists
    them at once); a batch given them (`join_shapes`: a restarted service's warm-up) makes those steps before its
    first one, and only those, and its requests get their tokens."""
    from devmap.generation import lanes
    from devmap.generation.step_cache import release_graphs, step_cache

    monkeypatch.setattr(lanes, "graphs_possible", lambda devices: True)
    release_graphs(model)
    reqs = requests(6, seed=4)
    shape = dict(rows=4, first_slot=12, cache_len=24, lanes=2, split_layers=[2])

    def made() -> set:
        entries = step_cache(model, "continuous").entries
        widths = {(0, key[1]) for key in entries if isinstance(key, tuple) and key[0] == "join"}
        return widths | {key[1:] for k in range(2) for key in entries.get(("rows", k), {}) if key[0] == "mixed"}

    try:
        run(model, reqs[:2], reqs[2:], **{k: v for k, v in shape.items() if k != "split_layers"})
        met = made()
        with continuous_batch(model, **shape) as batch:
            listed = batch.join_shapes()
        release_graphs(model)
        assert met and set(listed) == met and listed == sorted(listed)
        assert all((rows > 0) == every_layer_joined(model) for rows, _ in listed)
        with continuous_batch(model, **shape, join_shapes=listed[:1]):
            assert made() == {listed[0]}  # made before any step: only the shape asked for
        release_graphs(model)
        got, left, queue = run(model, reqs[:3], reqs[3:], rows=4, first_slot=12, cache_len=24, join_shapes=listed)
    finally:
        release_graphs(model)
    assert not left and not queue
    for r in reqs:
        assert got[r.owner] == alone(model, r.prompt, r.max_new_tokens), r.owner


def test_packs_hold_every_joiner_once_within_their_limit_in_few_widths():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=200, deadline=None, derandomize=True)
    @hypothesis.given(lengths=st.lists(st.integers(1, 600), min_size=1, max_size=64), extra=st.integers(0, 3000),
                      rows=st.integers(1, 64))
    def check(lengths, extra, rows):
        cache_len = max(lengths) + extra
        lengths = lengths[:rows]
        limit = joins.pack_limit(cache_len, rows)
        assert cache_len <= limit <= max(joins.PACK_TOKENS, cache_len)
        groups = joins.packs(lengths, limit)
        assert sorted(i for members in groups for i in members) == list(range(len(lengths)))
        widths = joins.pack_widths(limit)
        assert widths == sorted(set(widths)) and widths[-1] == limit and len(widths) <= 24
        for members in groups:
            tokens = sum(lengths[i] for i in members)
            width = joins.pack_width(tokens, limit)
            assert tokens <= width <= limit and width in widths
            assert width - tokens < max(64, tokens // 4 + 1)  # padding: less than a bucket's step
        assert len(groups) <= 2 * -(-sum(lengths) // limit)  # first fit, longest first: at most twice the fewest

    check()


def test_a_pack_reuses_a_made_width_up_to_twice_its_own_so_a_wave_of_joiners_settles_on_one_shape():
    made: set[int] = set()
    limit = 2048
    widths = []
    for tokens in (490, 380, 300, 450, 120, 40, 700):  # a wave's packs, then its tail, then a longer one
        width = joins.reused_width(tokens, limit, made.__contains__)
        assert tokens <= width <= 2 * joins.pack_width(tokens, limit) and width in joins.pack_widths(limit)
        made.add(width)
        widths.append(width)
    assert widths == [512, 512, 512, 512, 128, 128, 768]  # 120 → 128: 512 is more than twice its own width
    assert joins.reused_width(300, limit, lambda width: width in (320, 512)) == 320  # its own width, where made
    assert joins.reused_width(2000, limit, lambda width: True) == limit


def test_a_batch_runs_past_its_cache_length_reusing_columns(model, run):
    """Fourteen requests through two rows of a 20-column cache: the slot wraps around several times, prompts are
    copied in across the cache's end, and every request still gets the tokens of generating alone."""
    reqs = requests(14, seed=7)
    got, left, queue = run(model, reqs[:2], reqs[2:], rows=2, lanes=1, first_slot=12, cache_len=20)
    assert not left and not queue
    assert sum(r.max_new_tokens for r in reqs) > 3 * 20
    for r in reqs:
        assert got[r.owner] == alone(model, r.prompt, r.max_new_tokens), r.owner


def test_a_vacant_row_attends_to_the_column_its_step_writes_only(model):
    """Rows nobody holds (never taken, or whose request ended) read one column per step, not every column the steps
    wrote since; a row taken again attends to its new prompt and tokens only, and gets the tokens of generating
    alone."""
    short, long = SlotRequest(list(range(5, 9)), 3, "short"), SlotRequest(list(range(20, 27)), 12, "long")
    later = SlotRequest(list(range(40, 46)), 5, "later")
    got: dict = {"short": [], "long": [], "later": []}

    def attended() -> list[list[int]]:  # per row of the first stage: the columns its next step attends to
        inputs = batch.run.lanes[0].inputs[0]
        return [row.nonzero().flatten().tolist() for row in inputs.attended]

    with continuous_batch(model, rows=4, first_slot=8, cache_len=24, lanes=1, split_layers=[2]) as batch:
        batch.step([short, long])
        for _ in range(5):
            batch.step()
            for owner, token in batch.collect():
                got[owner].append(token)
        slot = batch.first_slot + batch.steps - 1  # the column the last step wrote
        columns = attended()
        assert len(columns[2]) == len(columns[3]) == 1  # never taken (nor computed: steps cover the first 2 rows)
        assert columns[0] == [slot]  # `short` had its 3 tokens issued: vacant since
        # `long`: its prompt and its steps' columns (a step that carried its prompt wrote none of its own)
        assert len(columns[1]) == len(long.prompt) + batch.steps - (1 if batch.mixing else 0)
        batch.step([later])  # takes row 0
        while batch.step():
            for owner, token in batch.collect():
                got[owner].append(token)
        for owner, token in batch.collect(everything=True):
            got[owner].append(token)
    for r in (short, long, later):
        assert got[r.owner] == alone(model, r.prompt, r.max_new_tokens), r.owner


def test_stopping_returns_the_unfinished_owners(model, run):
    reqs = [SlotRequest(list(range(5, 12)), 20, "a"), SlotRequest(list(range(7, 10)), 3, "b")]
    got, left, _ = run(model, reqs, [], rows=2, stop_after=6)
    assert left == ["a"] and len(got["b"]) == 3
    assert got["a"] == alone(model, reqs[0].prompt, 20)[:len(got["a"])] and 0 < len(got["a"]) < 20


def test_sampling_and_bad_arguments(model):
    reqs = requests(2)
    got = []
    generate_continuous(model, reqs, lambda *a: [], lambda o, t: got.append(t) or False, rows=2, first_slot=12,
                        cache_len=20, sampling=Sampling(do_sample=True, temperature=0.8, seed=3))
    assert len(got) == sum(r.max_new_tokens for r in reqs)  # a row stops at its request's max_new
    with pytest.raises(UsageError, match="1 to rows=1"):
        generate_continuous(model, reqs, lambda *a: [], lambda o, t: True, rows=1, first_slot=12, cache_len=20)
    with pytest.raises(UsageError, match="do not hold"):
        generate_continuous(model, reqs, lambda *a: [], lambda o, t: True, rows=2, first_slot=4, cache_len=20)


def test_any_arrival_pattern_gives_each_request_its_own_tokens(model):
    """Property: whatever the rows, lanes, prompts, lengths and moments requests are handed in (several at once,
    or held back some steps), each request gets the greedy tokens of generating it alone."""
    hypothesis = pytest.importorskip("hypothesis")  # a test dependency; the GPU machine's image may lack it
    st = hypothesis.strategies
    cache: dict = {}

    def alone_cached(prompt, new):
        key = (tuple(prompt), new)
        if key not in cache:
            cache[key] = alone(model, prompt, new)
        return cache[key]

    request = st.tuples(st.lists(st.integers(3, 511), min_size=1, max_size=10), st.integers(1, 8))

    @hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
    @hypothesis.given(rows=st.integers(1, 5), lanes=st.integers(1, 3), reqs=st.lists(request, min_size=1, max_size=9),
                      holds=st.lists(st.integers(0, 3), min_size=9, max_size=9), first=st.integers(1, 3))
    def check(rows, lanes, reqs, holds, first):
        items = [SlotRequest(prompt, new, i) for i, (prompt, new) in enumerate(reqs)]
        start, later = items[:min(first, rows)], items[min(first, rows):]
        got = {r.owner: [] for r in items}
        waits = {r.owner: holds[i % len(holds)] for i, r in enumerate(later)}

        def admit(free, longest, most):
            ready = [r for r in later if waits[r.owner] == 0 and len(r.prompt) <= longest and r.max_new_tokens <= most]
            for r in later:
                waits[r.owner] = max(waits[r.owner] - 1, 0)
            for r in ready[:free]:
                later.remove(r)
            return ready[:free]

        def emit(owner, token):
            got[owner].append(token)
            return len(got[owner]) >= items[owner].max_new_tokens

        left = generate_continuous(model, start, admit, emit, rows=rows, first_slot=10, cache_len=20,
                                   lanes=lanes, split_layers=[2])  # a small cache: its columns wrap around
        assert not left
        for r in items:
            if r in later:  # never started: the batch drained while it was held back
                assert got[r.owner] == []
            else:
                assert got[r.owner] == alone_cached(r.prompt, r.max_new_tokens), r.owner

    check()


def test_compiled_steps_join_like_eager_ones_and_compile_once(model, run, compiled_on_cpu):
    """compile=True (aot_eager on CPU: inductor's tracing and guards) with the cached-step paths: joining groups'
    prefills and the decode steps give the eager tokens, trace whole, and a second batch compiles nothing."""
    from devmap.generation.step_cache import release_graphs

    counters = compiled_on_cpu
    reqs = requests(7, seed=5)
    try:
        # the second batch repeats the first's shape; the third and fourth take new ones (rows, cache length): the
        # decode step is compiled with dynamic sizes, so a service's growing shapes never compile it again; each
        # batch captures its joins' every pack width (3 widths, then 8), one dynamic compile of the prefill
        for round, (rows, cache_len) in enumerate([(4, 40), (4, 40), (6, 48), (8, 64)]):
            got, left, queue = run(model, reqs[:2], reqs[2:], rows=rows, cache_len=cache_len, compile=True)
            assert not left and not queue
            assert got == {r.owner: alone(model, r.prompt, r.max_new_tokens) for r in reqs}
            if round == 0:
                graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    finally:
        release_graphs(model)


@pytest.mark.parametrize("at", [1, 3, 6])
def test_a_batch_moved_to_compiled_steps_mid_way_gives_every_request_its_tokens(model, compiled_on_cpu, at):
    """`recompile` between two steps (what a service does once a compile beside its serving ends): the rows, their
    caches and the tokens still coming back stay; requests already running, and those joining after, get the tokens
    of generating alone, and the compiled steps trace whole."""
    from devmap.generation.step_cache import release_graphs

    counters = compiled_on_cpu
    reqs = requests(12, seed=9)
    got: dict = {r.owner: [] for r in reqs}
    try:
        with continuous_batch(model, rows=4, first_slot=12, cache_len=40, lanes=2, split_layers=[2]) as batch:
            waiting, steps = list(reqs), 0
            while True:
                joining = [waiting.pop(0) for _ in range(min(len(waiting), batch.free_count()))]
                if not batch.step(joining):
                    break
                steps += 1
                if steps == at:  # right after the first joins, with rows mid-way, with rows freed and rejoined
                    assert not batch.run.compile
                    batch.recompile()
                    assert batch.run.compile
                for owner, token in batch.collect():
                    got[owner].append(token)
                    if len(got[owner]) == next(r.max_new_tokens for r in reqs if r.owner == owner):
                        batch.release(owner)
            for owner, token in batch.collect(everything=True):
                got[owner].append(token)
        assert steps > at + 2  # compiled steps ran
        assert {o: t[:r.max_new_tokens] for r in reqs for o, t in got.items() if o == r.owner} == \
            {r.owner: alone(model, r.prompt, r.max_new_tokens) for r in reqs}
        assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]
    finally:
        release_graphs(model)


def test_steps_carrying_prompts_compile_as_many_graphs_whatever_the_depth(tiny_llama, run_continuous,
                                                                          compiled_on_cpu):
    """Riding steps are compiled region by region like decode steps: each layer writes the pack's keys and values
    through its own part of the cache (no layer index to specialize on), so a model six layers deep traces as many
    operations and graphs as one two deep, with the tokens of generating alone."""
    from devmap.generation.step_cache import release_graphs

    counters = compiled_on_cpu
    reqs = requests(5, seed=3)
    graphs, traced = [], []
    for depth in (2, 6):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = tiny_llama(num_hidden_layers=depth)
        join_projections(model)
        try:
            got, left, queue = run_continuous(model, reqs[:2], reqs[2:], rows=4, first_slot=12, cache_len=40,
                                              lanes=1, split_layers=[1], compile=True)
        finally:
            release_graphs(model)
        assert not left and not queue
        assert got == {r.owner: alone(model, r.prompt, r.max_new_tokens, split=1) for r in reqs}
        graphs.append(counters["stats"]["unique_graphs"])
        traced.append(counters["stats"]["calls_captured"])
    assert graphs[0] > 0 and graphs[1] == graphs[0] and traced[1] == traced[0]


def test_joiners_beyond_a_steps_prompt_tokens_wait_in_their_rows(model, run, monkeypatch):
    """Steps that carry joiners' prompts take the oldest queued ones up to their prompt tokens (one at least): the
    others hold their rows and ride later steps, and get the tokens of generating alone; a batch stopped while some
    still wait returns them as unfinished, with no tokens."""
    if not every_layer_joined(model):
        pytest.skip("joiners ride decode steps where every layer is joined")
    monkeypatch.setattr(mixed_joins, "RIDING_TOKENS", 12)
    reqs = requests(9, seed=11)
    got, left, queue = run(model, reqs[:6], reqs[6:], rows=6)
    assert not left and not queue
    for r in reqs:
        assert got[r.owner] == alone(model, r.prompt, r.max_new_tokens), r.owner
    got, left, _ = run(model, reqs[:6], [], rows=6, stop_after=0)  # stopped after its first step
    waited = [r.owner for r in reqs[:6] if not got[r.owner]]
    assert waited and set(waited) <= set(left)
    for r in reqs[:6]:
        assert r.owner in left or len(got[r.owner]) == r.max_new_tokens
        assert got[r.owner] == alone(model, r.prompt, r.max_new_tokens)[:len(got[r.owner])]


@pytest.mark.parametrize("beside", ["captures paused", "a compile beside"])
def test_eager_steps_carry_more_prompt_tokens_while_a_compile_runs_beside(model, run, monkeypatch, beside):
    """While a compile runs beside serving (captures paused, or `compiling_beside`: the steps compiling in a process
    of their own) a batch's eager steps carry up to BESIDE_RIDING_TOKENS (the first step then takes every joiner that
    RIDING_TOKENS would leave waiting), with the tokens of generating alone; compiled steps keep RIDING_TOKENS."""
    from devmap.generation.graphed_step import captures_paused

    if not every_layer_joined(model):
        pytest.skip("joiners ride decode steps where every layer is joined")
    monkeypatch.setattr(mixed_joins, "RIDING_TOKENS", 12)
    monkeypatch.setattr(mixed_joins, "BESIDE_RIDING_TOKENS", 1000)
    during = (lambda: captures_paused(but_while_tracing=True)) if beside == "captures paused" \
        else mixed_joins.compiling_beside
    reqs = requests(6, seed=11)
    got, _, _ = run(model, reqs, [], rows=6, stop_after=0)  # stopped after its first step
    assert not all(got[r.owner] for r in reqs), "some joiners wait for later steps"
    with during():
        got, _, _ = run(model, reqs, [], rows=6, stop_after=0)
    for r in reqs:
        assert got[r.owner], f"{r.owner} rode the first step"
        assert got[r.owner] == alone(model, r.prompt, r.max_new_tokens)[:len(got[r.owner])]
    with during():
        got, left, queue = run(model, reqs[:3], reqs[3:], rows=6)
    assert not left and not queue
    assert got == {r.owner: alone(model, r.prompt, r.max_new_tokens) for r in reqs}
    compiled = mixed_joins.Riding(SimpleNamespace(run=SimpleNamespace(compile=True)), SimpleNamespace(limit=4096))
    eager = mixed_joins.Riding(SimpleNamespace(run=SimpleNamespace(compile=False)), SimpleNamespace(limit=4096))
    with during():
        assert compiled.riding_tokens == 12 and eager.riding_tokens == 1000
    assert eager.riding_tokens == 12  # the block ended


def test_each_lanes_step_carries_its_own_joiners_prompt_tokens(model, monkeypatch):
    """Two lanes, RIDING_TOKENS=12: one step carries a 10-token prompt in each lane (each lane's pack its own budget),
    while a lane's second joiner waits for its next step; every request gets the tokens of generating alone."""
    if not every_layer_joined(model):
        pytest.skip("joiners ride decode steps where every layer is joined")
    monkeypatch.setattr(mixed_joins, "RIDING_TOKENS", 12)
    reqs = [SlotRequest(list(range(7 + i, 17 + i)), 4, f"r{i}") for i in range(4)]
    got = {r.owner: [] for r in reqs}
    with continuous_batch(model, rows=4, first_slot=12, cache_len=40, lanes=2, split_layers=[2],
                          graphs=False) as batch:
        seen, riders = [], batch.joins.riders
        batch.joins.riders = lambda: seen.append(taken := riders()) or taken
        batch.step(reqs)  # lane 0 takes r0 and r2, lane 1 r1 and r3 (the lanes kept even)
        assert {k: [request.owner for request, _ in riding] for k, riding in seen[0].items()} == \
            {0: ["r0"], 1: ["r1"]}
        assert batch.joins.waiting() == ["r2", "r3"]
        while batch.step([]):
            for owner, token in batch.collect():
                got[owner].append(token)
                if len(got[owner]) == 4:
                    batch.release(owner)
        for owner, token in batch.collect(everything=True):
            got[owner].append(token)
    for r in reqs:
        assert got[r.owner][:4] == alone(model, r.prompt, 4), r.owner


def test_owners_dropped_after_their_last_token_never_hide_a_later_owners_tokens(model):
    """Owners made as requests come and dropped once they have their tokens may be freed, and a later owner may then
    get the same id(): every request still gets all its tokens."""
    finished: list[int] = []
    made = [0]

    def fresh() -> SlotRequest:
        made[0] += 1
        return SlotRequest([5 + made[0] % 7, 9, 11], 3, {"n": made[0], "got": 0})

    def admit(free, longest, most):
        count = min(free, 40 - made[0])
        return [fresh() for _ in range(count)]

    def emit(owner, token):
        owner["got"] += 1
        if owner["got"] == 3:
            finished.append(owner["n"])
            return True
        return False

    left = generate_continuous(model, [fresh(), fresh()], admit, emit, rows=2, first_slot=12, cache_len=40,
                               split_layers=[2])
    assert not left and sorted(finished) == list(range(1, 41))


def test_a_decode_step_reads_the_parameters_counted_from_the_config(tiny_llama):
    model = tiny_llama()
    products = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert mixed_joins.decoder_parameters(model.config) == products


def test_steps_carry_prompts_by_default_where_the_weights_bound_them(monkeypatch, tiny_llama):
    """A 13B LLaMA rides by default, a 1.1B one and a 4-bit one join apart (steps bound by the host; 4-bit products
    of rows and a pack slower than bf16's); `riding` decides where every layer is joined, and a model whose layers are
    not cannot ride."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from devmap.kernels.four_bit_linear import FourBitLinear
    from devmap.kernels.four_bit_layout import FourBitWeight
    from test_four_bit_products import int4_layers

    monkeypatch.setattr(mixed_joins, "RIDING_MIN_PARAMETERS", 10_000_000_000)  # the default (the tests set it to 0)
    with torch.device("meta"):
        llama_13b = LlamaForCausalLM(LlamaConfig(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                                 num_attention_heads=40))
        tinyllama = LlamaForCausalLM(LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                                 num_attention_heads=32, num_key_value_heads=4))
    assert mixed_joins.rides_by_default(llama_13b) and not mixed_joins.rides_by_default(tinyllama)
    packed = torch.empty(5120, 2560, dtype=torch.uint8, device="meta")
    scale = torch.empty(5120, 40, dtype=torch.bfloat16, device="meta")
    llama_13b.model.layers[0].self_attn.q_proj = FourBitLinear(FourBitWeight(packed, scale, scale), None)
    assert not mixed_joins.rides_by_default(llama_13b)
    monkeypatch.setattr(mixed_joins, "RIDING_MIN_PARAMETERS", 0)
    joined, plain, four_bit = tiny_llama(), tiny_llama(), int4_layers(tiny_llama())
    for model in (joined, four_bit):
        assert join_projections(model) == 2 * model.config.num_hidden_layers
    for model, riding, rides in [(joined, None, True), (joined, True, True), (joined, False, False),
                                 (plain, True, False), (four_bit, None, False), (four_bit, True, True)]:
        with continuous_batch(model, rows=2, first_slot=8, cache_len=16, riding=riding) as batch:
            assert batch.mixing is rides


def test_scored_tokens_carry_the_log_softmax_of_the_models_logits(model, tiny_llama, scored_run):
    """Every token of a scoring batch (joiners' first tokens from their prefills or riding steps, and the decode
    steps') comes with its log-probability and the top 3 alternatives', those of transformers' logits for the
    request's tokens so far; greedy tokens are the most likely."""
    torch.manual_seed(0)
    reference = tiny_llama()  # the same weights, without joined projections: transformers' own forward
    reqs = requests(7, seed=4)
    got = scored_run(model, reqs, rows=3, first_slot=16, cache_len=40, top=3, split_layers=[2])
    for request in reqs:
        pairs = got[request.owner]
        assert len(pairs) == request.max_new_tokens
        ids = request.prompt + [token for token, _ in pairs]
        with torch.no_grad():
            logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), -1)
        for i, (token, (value, top)) in enumerate(pairs):
            row = logprobs[len(request.prompt) - 1 + i]
            best = row.topk(3)
            assert token == best.indices[0].item()
            assert abs(value - row[token].item()) < 1e-4
            assert [t for t, _ in top] == best.indices.tolist()
            assert max(abs(v - b) for (_, v), b in zip(top, best.values.tolist())) < 1e-4
    plain = scored_run(model, reqs, rows=3, first_slot=16, cache_len=40, top=None, split_layers=[2])
    assert all(score is None for pairs in plain.values() for _, score in pairs)
    assert {o: [t for t, _ in p] for o, p in plain.items()} == {o: [t for t, _ in p] for o, p in got.items()}
