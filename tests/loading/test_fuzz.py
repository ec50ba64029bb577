"""Property and fuzz tests for what a stranger controls: memory strings, device maps, safetensors headers and
index files. Every input either works or raises a DevmapError; nothing else escapes, no file is written."""

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
pytest.importorskip("hypothesis")  # a test dependency; the GPU machine's image may lack it
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from devmap import load
from devmap.planning.budget import resolve_budget
from devmap.cli import main
from devmap.planning.device_maps import normalize_device_map
from devmap.errors import CheckpointError, DevmapError, UsageError
from devmap.planning.devices import parse_device_key
from devmap.planning.memory import _UNITS, parse_max_memory, parse_size
from devmap.planning.device_maps import validate_device_map
from devmap.testing import ToyModel

from tiny_llama import write_tiny_llama

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# --- memory strings and budgets -----------------------------------------------------------------------------


@FAST
@given(number=st.integers(0, 10**6), unit=st.sampled_from(sorted(_UNITS)), upper=st.booleans(), space=st.booleans())
def test_parse_size_reads_every_unit(number, unit, upper, space):
    text = f"{number}{' ' if space else ''}{unit.upper() if upper else unit.lower()}"
    assert parse_size(text) == number * _UNITS[unit]


@FAST
@given(percent=st.floats(0.01, 100), total=st.integers(1, 2**50))
def test_parse_size_percentages_stay_within_the_device(percent, total):
    assert 0 <= parse_size(f"{percent}%", total=total) <= total


@FAST
@given(text=st.text(max_size=30))
def test_parse_size_any_text_is_a_size_or_a_usage_error(text):
    try:
        assert parse_size(text) >= 0
    except UsageError:
        pass


@FAST
@given(text=st.text(alphabet=st.sampled_from("0123456789=,:cpudiskCUDAGiBMK% .-"), max_size=40))
def test_max_memory_any_text_is_budgets_or_a_usage_error(text):
    try:
        budget = resolve_budget(text)
    except UsageError:
        return
    assert all(v >= 0 for v in budget.limits.values())


keys = st.one_of(st.integers(0, 7), st.sampled_from(["cpu", "disk"]), st.integers(0, 7).map(lambda i: f"cuda:{i}"))
sizes = st.one_of(st.integers(0, 2**45), st.integers(0, 4096).map(lambda n: f"{n}MiB"))


@FAST
@given(spec=st.dictionaries(keys, sizes, min_size=1, max_size=6))
def test_max_memory_string_and_dict_agree(spec):
    text = ",".join(f"{k}={v}" for k, v in spec.items())
    as_dict = {parse_device_key(k): parse_size(v) for k, v in spec.items()}
    assert {k: parse_size(v) for k, v in parse_max_memory(text).items()} == as_dict


@FAST
@given(key=st.one_of(st.text(max_size=12), st.integers(-5, 2**40), st.booleans(), st.none(), st.floats()))
def test_device_keys_parse_or_refuse(key):
    try:
        parsed = parse_device_key(key)
    except UsageError:
        return
    assert parsed in ("cpu", "disk") or (isinstance(parsed, int) and parsed >= 0)


# --- device maps --------------------------------------------------------------------------------------------

MODULES = ["", "net1", "relu", "net2", "net1.weight", "net2.bias"]
devices = st.one_of(st.integers(-1, 3), st.sampled_from(["cpu", "disk", "cuda:1", "cuda", "gpu", "", "mps"]),
                    st.just(torch.device("cpu")), st.booleans(), st.none())


@FAST
@given(spec=st.dictionaries(st.one_of(st.sampled_from(MODULES), st.text(max_size=8)), devices, max_size=5))
def test_explicit_device_maps_place_every_tensor_or_refuse(spec):
    model = ToyModel()
    budget = resolve_budget({0: "1GiB", 1: "1GiB", "cpu": "1GiB"})
    try:
        placed = validate_device_map(model, normalize_device_map(spec), budget)
    except UsageError:
        return
    from devmap.planning.device_maps import owner_of

    assert all(owner_of(name, placed) is not None for name, _ in model.named_parameters())


@FAST
@given(spec=st.one_of(st.text(max_size=20), st.integers(-3, 10), st.none(), st.lists(st.integers(), max_size=2)))
def test_any_device_map_value_is_a_map_or_a_usage_error(spec):
    try:
        result = normalize_device_map(spec)
    except UsageError:
        return
    assert isinstance(result, (str, dict))


# --- safetensors headers and index files ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny LLaMA in two shards, written by transformers."""
    path = write_tiny_llama(tmp_path_factory.mktemp("fuzz"), "40KB", hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, vocab_size=64, max_position_embeddings=64)
    assert (path / "model.safetensors.index.json").is_file()
    return path


def read_header(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_header(file: Path, header_text: str, data: bytes) -> None:
    encoded = header_text.encode()
    file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def first_shard(path: Path) -> Path:
    return sorted(path.glob("model-*.safetensors"))[0]


def assert_refused_cleanly(path: Path, cli: bool = False) -> None:
    before = sorted(p.name for p in path.parent.rglob("*"))
    with pytest.raises(DevmapError):
        load(str(path), max_memory={"cpu": "1GiB"}, offload_folder=path.parent / "offload")
    assert sorted(p.name for p in path.parent.rglob("*")) == before  # nothing written, no offload folder
    if cli:
        result = CliRunner().invoke(main, ["load", str(path), "--max-memory", "cpu=1GiB"])
        assert result.exit_code in (1, 2) and "Traceback" not in result.output
        assert result.output.startswith("Error: ") and result.output.count("\n") == 1


def mutate_entry(change):
    def apply(header: dict, data: bytes) -> tuple[str, bytes]:
        names = sorted(k for k in header if k != "__metadata__")
        change(header, names)
        return json.dumps(header), data
    return apply


def _overlap(header, names):
    header[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]


def _duplicate(header, names):
    text = json.dumps({k: header[k] for k in names[:1]})
    return text


NAMED = {
    "offsets past the end": mutate_entry(lambda h, n: h[n[0]].update(data_offsets=[10**9, 10**9 + 4 * 32 * 32])),
    "overlapping offsets": mutate_entry(_overlap),
    "negative shape": mutate_entry(lambda h, n: h[n[0]].update(shape=[-1, 4], data_offsets=[16, 0])),
    "shape disagrees with the config": mutate_entry(lambda h, n: h[n[0]].update(shape=[1])),
    "dtype disagrees with the config": mutate_entry(lambda h, n: h[n[0]].update(dtype="I32")),
    "unknown dtype": mutate_entry(lambda h, n: h[n[0]].update(dtype="F7")),
    "float offsets": mutate_entry(lambda h, n: h[n[0]].update(data_offsets=[0.0, 4.5])),
    "shape not a list": mutate_entry(lambda h, n: h[n[0]].update(shape="big")),
    "duplicate names": lambda h, d: (json.dumps(h)[:-1] + ", " + json.dumps(dict([next(
        (k, v) for k, v in h.items() if k != "__metadata__")]))[1:], d),
    "header not an object": lambda h, d: ("[]", d),
    "data cut short": lambda h, d: (json.dumps(h), d[: len(d) // 2]),
}


@pytest.mark.parametrize("mutation", sorted(NAMED))
def test_mutated_safetensors_header_is_refused(checkpoint, tmp_path, mutation):
    path = tmp_path / "model"
    shutil.copytree(checkpoint, path)
    shard = first_shard(path)
    header, data = read_header(shard)
    text, data = NAMED[mutation](header, data)
    write_header(shard, text, data)
    assert_refused_cleanly(path, cli=mutation in ("duplicate names", "overlapping offsets", "data cut short"))


@pytest.mark.parametrize("length", [0, 2**63, 2**40, 7])
def test_header_length_field_is_refused(checkpoint, tmp_path, length):
    path = tmp_path / "model"
    shutil.copytree(checkpoint, path)
    shard = first_shard(path)
    raw = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", length) + raw[8:])
    assert_refused_cleanly(path)


@FAST
@given(cut=st.integers(0, 4000))
def test_truncated_shard_is_refused(checkpoint, cut):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        shutil.copytree(checkpoint, path)
        shard = first_shard(path)
        shard.write_bytes(shard.read_bytes()[:cut])
        assert_refused_cleanly(path)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_header_bytes_load_or_refuse(checkpoint, data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        shutil.copytree(checkpoint, path)
        shard = first_shard(path)
        raw = bytearray(shard.read_bytes())
        (length,) = struct.unpack("<Q", raw[:8])
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, 8 + length - 1))
            raw[at] = data.draw(st.integers(0, 255))
        shard.write_bytes(bytes(raw))
        try:
            model = load(str(path), max_memory={"cpu": "1GiB"})
        except DevmapError:
            return
        # a header that still loads changed nothing the model reads (a byte of padding or metadata)
        assert_same_weights(model, load(str(checkpoint), max_memory={"cpu": "1GiB"}))


def assert_same_weights(model, reference) -> None:
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name


index_values = st.one_of(st.text(max_size=20), st.integers(), st.none(), st.sampled_from(
    ["../model-00001-of-00002.safetensors", "/etc/hostname", "model-00009-of-00009.safetensors", ".", "a/../b"]))


@FAST
@given(changes=st.dictionaries(st.text(max_size=30), index_values, min_size=1, max_size=3),
       drop=st.booleans())
def test_mutated_index_loads_or_refuses(checkpoint, changes, drop):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        shutil.copytree(checkpoint, path)
        index_file = path / "model.safetensors.index.json"
        index = json.loads(index_file.read_text())
        if drop:
            index["weight_map"].pop(sorted(index["weight_map"])[0])
        index["weight_map"].update(changes)
        index_file.write_text(json.dumps(index))
        with pytest.raises(DevmapError):
            load(str(path), max_memory={"cpu": "1GiB"})


@pytest.mark.parametrize("text", ['{"weight_map": []}', "[]", "{", '{"weight_map": {"a": "b"}, "weight_map": {}}',
                                  '{"weight_map": {"1": 1}}'])
def test_malformed_index_is_refused(checkpoint, tmp_path, text):
    path = tmp_path / "model"
    shutil.copytree(checkpoint, path)
    (path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError):
        load(str(path), max_memory={"cpu": "1GiB"})
