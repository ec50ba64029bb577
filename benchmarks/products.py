"""Every quantized product devmap serves, against the libraries that do the same job, on one GPU in one run: GPU
microseconds per product (captured in a CUDA graph, over copies of the weight that the L2 cannot hold at once) for
int8, int4, nf4 and fp8 weights at 1, 32 and 256 rows, on LLaMA-2-13B's and 70B's layer shapes (query/key/value and
gate/up joined, as devmap runs them), beside bf16 and the floor of reading the weights (and scales) once.

Candidates per scheme: devmap's own products (`devmap.kernels.int8_products`, `four_bit_products`,
`fp8_products`; the last eager and compiled, its tokens' quantization being torch operations); torchao eager and
under torch.compile, int8 and fp8 also with the inductor settings torchao sets by default (int8 weight-only and with
int8 activations, int4 tinygemm, int4 preshuffled through mslk, fp8 with a scale per row through torch._scaled_mm or
mslk); bitsandbytes (int8, nf4); gemlite (int8, int4, fp8 with and without
quantized activations). A candidate that cannot run here (a
library not installed, a kernel this card lacks) is listed with its reason instead of a time; one a CUDA graph cannot
capture (devmap's steps are graphs) is timed as issued from the host and listed below the table. The table gives
each candidate's time, the fastest library's, and devmap's ratio to it: devmap keeps its own kernel only where it
beats every library by 10% or more at the rows serving uses. A candidate's first product (a compile, a library's
tuning: what every new process pays before it runs at speed) is printed beside its row where it took a second or more.

Run on one GPU:  PYTHONPATH=/tmp/site:. python3 benchmarks/products.py [--shapes 13b,70b] [--rows 1,32,256]
[--schemes int8,int4,nf4,fp8] [--products qkv,o,gate_up,down] [--without gemlite,mslk] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import best_seconds, copy_bandwidth, graph_timed_us  # noqa: E402

SHAPES = {  # (out, in) of a layer's four products, as devmap runs them
    "13b": {"qkv": (15360, 5120), "o": (5120, 5120), "gate_up": (27648, 5120), "down": (5120, 13824)},
    "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
}
GENERATOR = torch.Generator().manual_seed(0)
L2_OVER = 4 * 2**30 // 32  # copies of a weight until they hold at least this many bytes (past any L2)
Product = Callable[[torch.Tensor], torch.Tensor]


def plain_linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free Linear holding a copy of `weight`, made on the meta device: a Linear made on the GPU draws its
    initial weights from the GPU's generator, which a failed capture (a candidate that cannot be captured) leaves in
    capture mode, failing every later candidate ("Offset increment outside graph capture")."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return linear


def quantized_linear(weight: torch.Tensor, config: Any) -> nn.Module:
    """A Linear of `weight` quantized in place by torchao's `quantize_` with `config`."""
    from torchao.quantization import quantize_

    linear = plain_linear(weight)
    quantize_(linear, config)
    return linear


def devmap_linear(weight: torch.Tensor, scheme: str, library: str | None = None) -> nn.Module:
    """The Linear as devmap's loader quantizes it (`loading.quantize.quantize_linears`), with the scheme's library
    or `library` (bitsandbytes' int8)."""
    from devmap.loading.quantize import quantize_linears
    from devmap.planning.quantization import LIBRARIES, Quantization

    holder = nn.Module()
    holder.linear = plain_linear(weight)
    quantize_linears(holder, ["linear"], Quantization(scheme, library or LIBRARIES[scheme]))
    return holder.linear


def compiled(module: nn.Module, tuned: bool = False) -> Product:
    """`module` through torch.compile; `tuned`: with the inductor settings torchao sets by default
    (`set_inductor_config=True`: coordinate-descent tuning, int8 products fused with their scales), as its users run."""
    options = {"coordinate_descent_tuning": True, "coordinate_descent_check_all_directions": True,
               "force_fuse_int_mm_with_mul": True} if tuned else None
    return torch.compile(module, dynamic=False, options=options)


def candidates(scheme: str, weight: torch.Tensor) -> dict[str, Callable[[], Product]]:
    """{name: a function that makes the candidate's product of x (its own quantized copy of `weight`)}."""
    made: dict[str, Callable[[], Product]] = {}
    if scheme == "bf16":
        made["cuBLAS"] = lambda: plain_linear(weight)
    elif scheme == "int8":
        made["devmap"] = lambda: devmap_int8(weight)
        made["torchao"] = lambda: devmap_linear(weight, "int8")
        made["torchao compiled"] = lambda: compiled(devmap_linear(weight, "int8"))
        made["torchao compiled, tuned"] = lambda: compiled(devmap_linear(weight, "int8"), tuned=True)
        made["torchao w8a8 compiled"] = lambda: compiled(torchao_linear(weight, "int8 dynamic"))
        made["bitsandbytes"] = lambda: devmap_linear(weight, "int8", "bitsandbytes")
        made["gemlite"] = lambda: gemlite_linear(weight, "int8")
    elif scheme == "int4":
        made["devmap"] = lambda: devmap_four_bit(devmap_linear(weight, "int4"))
        made["torchao tinygemm"] = lambda: devmap_linear(weight, "int4")
        made["torchao tinygemm compiled"] = lambda: compiled(devmap_linear(weight, "int4"))
        made["torchao preshuffled (mslk)"] = lambda: torchao_linear(weight, "int4 preshuffled")
        made["gemlite"] = lambda: gemlite_linear(weight, "int4")
    elif scheme == "nf4":
        made["devmap"] = lambda: devmap_four_bit(devmap_linear(weight, "nf4"))
        made["bitsandbytes"] = lambda: devmap_linear(weight, "nf4")
    elif scheme == "fp8":
        made["devmap"] = lambda: devmap_fp8(weight)
        made["devmap compiled"] = lambda: torch.compile(devmap_fp8(weight), dynamic=False)
        made["torchao"] = lambda: devmap_linear(weight, "fp8")
        made["torchao compiled"] = lambda: compiled(devmap_linear(weight, "fp8"))
        made["torchao compiled, tuned"] = lambda: compiled(devmap_linear(weight, "fp8"), tuned=True)
        made["torchao _scaled_mm compiled"] = lambda: compiled(torchao_linear(weight, "fp8 torch"))
        made["torchao mslk compiled"] = lambda: compiled(torchao_linear(weight, "fp8 mslk"))
        made["gemlite"] = lambda: gemlite_linear(weight, "fp8")
        made["gemlite weight-only"] = lambda: gemlite_linear(weight, "fp8 weight-only")
    return made


def devmap_int8(weight: torch.Tensor) -> Product:
    from devmap.compat import torchao_int8_parts
    from devmap.kernels.int8_products import Int8Weight, product

    qdata, scale, _ = torchao_int8_parts(devmap_linear(weight, "int8").weight)
    int8 = Int8Weight(qdata, scale)
    return lambda x: product(x, int8)


def devmap_fp8(weight: torch.Tensor) -> Product:
    """devmap's fp8 product (`kernels.fp8_products`): the tokens quantized as torchao does, then its kernel at decode
    rows, `torch._scaled_mm` past them; compiled, the tokens' quantization is fused as in a served step."""
    from devmap.compat import torchao_fp8_parts
    from devmap.kernels.fp8_products import Fp8Weight, product

    linear = devmap_linear(weight, "fp8")
    parts = torchao_fp8_parts(linear.weight)
    if parts is None:
        raise RuntimeError("not torchao's float8 weight with a scale per row")
    fp8 = Fp8Weight.of(*parts, linear.weight)
    return lambda x: product(x, fp8)


def devmap_four_bit(linear: nn.Module) -> Product:
    from devmap.kernels.four_bit_linear import four_bit_weight
    from devmap.kernels.four_bit_products import product

    four_bit = four_bit_weight(linear)
    if four_bit is None:
        raise RuntimeError("devmap's layout does not take this weight")
    return lambda x: product(x, four_bit)


def torchao_linear(weight: torch.Tensor, kind: str) -> nn.Module:
    """torchao's configs devmap's loader does not use: int8 activations, int4 through mslk, fp8 by kernel."""
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Int4WeightOnlyConfig,
                                      Int8DynamicActivationInt8WeightConfig, PerRow)

    if kind == "int8 dynamic":
        return quantized_linear(weight, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    if kind == "int4 preshuffled":
        return quantized_linear(weight, Int4WeightOnlyConfig(group_size=128, int4_packing_format="preshuffled",
                                                             set_inductor_config=False))
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    return quantized_linear(weight, Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow(), kernel_preference=KernelPreference(kind.split()[1]), set_inductor_config=False))


def gemlite_linear(weight: torch.Tensor, kind: str) -> Product:
    """gemlite's Linear of `weight`: "int8" weight-only with a scale per output row, "int4" weight-only in groups of
    128 (asymmetric: a scale and zero per group, as devmap's int4), "fp8" with activations quantized per token as they
    come, "fp8 weight-only"."""
    from gemlite import helper  # type: ignore[import-not-found]

    device = str(weight.device)
    if kind == "int4":
        groups = weight.float().reshape(weight.shape[0], -1, 128)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-8)
        zero = (-low / scale).round()
        codes = (groups / scale + zero).round().clamp(0, 15).to(torch.uint8).reshape(weight.shape)
        return helper.A16W4_HQQ_INT(device=device, dtype=torch.bfloat16).from_weights(
            codes, scale.squeeze(-1).to(torch.bfloat16), zero.squeeze(-1).to(torch.bfloat16))
    maker = {"int8": helper.A16W8_INT8, "fp8": helper.A8W8_fp8_dynamic, "fp8 weight-only": helper.A16W8_FP8}[kind]
    return maker(device=device).from_linear(plain_linear(weight))


def stored_bytes(weight: torch.Tensor, scheme: str) -> int:
    """Bytes a product reads of its weight: the quantized weight and what its library keeps beside it."""
    from devmap.planning.quantization import parse_quantization, weight_extra_bytes

    if scheme == "bf16":
        return weight.numel() * 2
    quantization = parse_quantization(scheme)
    return weight.numel() * quantization.bits // 8 + weight_extra_bytes(quantization, *weight.shape)


def timed(build: Callable[[], Product], weight_bytes: int, x: torch.Tensor) -> tuple[float, bool, float]:
    """Microseconds per product over enough copies of the weight to be read from HBM, each called in turn, whether
    they were captured in a CUDA graph (as devmap's steps run; a product that cannot be captured is timed as issued
    from the host instead), and the seconds its first product took (a compile's or a library's tuning: what a process
    pays before the product runs at speed)."""
    copies = [build() for _ in range(max(1, min(8, -(-L2_OVER // weight_bytes))))]
    torch.cuda.synchronize()
    started = time.perf_counter()
    copies[0](x)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - started
    turn = [0]

    def call() -> None:
        copies[turn[0] % len(copies)](x)
        turn[0] += 1

    try:
        return graph_timed_us(call, repeat=8 * len(copies)), True, first_s
    except Exception:  # noqa: BLE001 - the capture's failure is what this row reports
        torch.cuda.synchronize()
        release_generator()
        repeat = 8 * len(copies)
        return best_seconds(lambda: [call() for _ in range(repeat)], 5) / repeat * 1e6, False, first_s


def release_generator() -> None:
    """Give the GPU's generator a fresh copy of its state: a failed capture ends before the generator leaves capture
    mode, and every later draw from it would fail."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    generator.graphsafe_set_state(generator.clone_state())


def random(*shape: int, scale: float = 1.0) -> torch.Tensor:
    """Normal bf16 values on the GPU, drawn on the host: a failed capture can leave the GPU's generator expecting a
    graph ("Offset increment outside graph capture"), which must not end the run."""
    return (torch.randn(*shape, generator=GENERATOR) * scale).to(torch.bfloat16).to("cuda")


def why(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="13b,70b")
    parser.add_argument("--rows", default="1,32,256")
    parser.add_argument("--schemes", default="int8,int4,nf4,fp8")
    parser.add_argument("--products", default="qkv,o,gate_up,down", help="which of a layer's products to time")
    parser.add_argument("--without", default="", help="candidates left out: comma-separated parts of their names "
                        "(gemlite tunes for about a minute per weight shape)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    left_out = [part for part in args.without.split(",") if part]
    from devmap.compat import raise_recompile_limit

    raise_recompile_limit(256)  # compiled candidates: one entry per weight shape and rows
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; HBM {bandwidth / 1e12:.2f} TB/s", flush=True)
    results = []
    for shape_name in args.shapes.split(","):
        for product_name, (out, inner) in SHAPES[shape_name].items():
            if product_name not in args.products.split(","):
                continue
            weight = random(out, inner, scale=0.02)
            for scheme in ["bf16", *args.schemes.split(",")]:
                size = stored_bytes(weight, scheme)
                for rows in (int(r) for r in args.rows.split(",")):
                    x = random(rows, inner)
                    row: dict[str, Any] = {"shape": f"{shape_name} {product_name}", "scheme": scheme, "rows": rows,
                                           "floor_us": size / bandwidth * 1e6, "times_us": {}, "cannot": {},
                                           "uncaptured_us": {}, "first_call_s": {}}
                    for name, build in candidates(scheme, weight).items():
                        if any(part in name for part in left_out):
                            continue
                        try:  # a library missing, a kernel this card lacks: recorded with its reason
                            us, captured, first_s = timed(build, size, x)
                            row["times_us" if captured else "uncaptured_us"][name] = us
                            row["first_call_s"][name] = first_s
                        except Exception as exc:
                            row["cannot"][name] = why(exc)
                        torch.cuda.empty_cache()
                    results.append(row)
                    print(line(row), flush=True)
                    if args.out:  # after every row: a run cut short keeps what it measured
                        Path(args.out).mkdir(parents=True, exist_ok=True)
                        (Path(args.out) / "products.json").write_text(json.dumps(results, indent=2))
            del weight
            torch.cuda.empty_cache()
    report(results)


def line(row: dict[str, Any]) -> str:
    times = ", ".join(f"{name} {us:.1f}" for name, us in sorted(row["times_us"].items(), key=lambda kv: kv[1]))
    slow = ", ".join(f"{name} {s:.1f} s" for name, s in row["first_call_s"].items() if s >= 1)
    return (f"{row['shape']:>12} {row['scheme']:>4} {row['rows']:4d} rows: floor {row['floor_us']:.1f} us; {times}"
            + (f" (first product over a second: {slow})" if slow else ""))


def report(results: list[dict[str, Any]]) -> None:
    """One table row per (shape, scheme, rows): floor, devmap, the fastest library and devmap's ratio to it."""
    print("\n| shape | scheme | rows | floor µs | devmap µs | fastest library (µs) | its time ÷ devmap's "
          "| floor ÷ best |")
    print("|---|---|---|---|---|---|---|---|")
    for row in results:
        times = row["times_us"]
        ours = min((v for k, v in times.items() if k.startswith("devmap")), default=None)  # eager or compiled
        libraries = {k: v for k, v in times.items() if not k.startswith("devmap")}
        best_name, best = min(libraries.items(), key=lambda kv: kv[1]) if libraries else ("-", None)
        fastest = min([t for t in (ours, best) if t is not None], default=None)
        ratio = f"{best / ours:.2f}x" if ours and best else "-"
        share = f"{row['floor_us'] / fastest:.0%}" if fastest else "-"
        print(f"| {row['shape']} | {row['scheme']} | {row['rows']} | {row['floor_us']:.1f} | "
              f"{f'{ours:.1f}' if ours else '-'} | {best_name} ({f'{best:.1f}' if best else '-'}) | {ratio} | "
              f"{share} |")
    cannot = {(row["scheme"], name): reason for row in results for name, reason in row["cannot"].items()}
    for (scheme, name), reason in sorted(cannot.items()):
        print(f"{scheme} {name}: cannot run here: {reason}")
    for row in results:
        for name, us in row.get("uncaptured_us", {}).items():
            print(f"{row['shape']} {row['scheme']} {row['rows']} rows, {name}: {us:.1f} us issued from the host "
                  "(a CUDA graph cannot capture it, so devmap's steps cannot run it)")


if __name__ == "__main__":
    main()
