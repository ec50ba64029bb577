"""Plan a 70B LLaMA over simulated GPUs and print where each block goes, per device.

Shows: planning on the meta device (no memory, no weights, no GPU needed), strategies, bf16 sizes, and
what happens when the GPUs are too small (offload to cpu, or an error that says how much is missing).
Run: python examples/plan_70b.py
"""

import devmap
from devmap.planning.memory import format_bytes

for strategy, memory in (("balanced", {0: "80GiB", 1: "80GiB"}),
                         ("sequential", {0: "40GiB", 1: "40GiB", "cpu": "100GiB"})):
    plan = devmap.plan("llama-2-70b", strategy, max_memory=memory, dtype="bf16")
    print(f"\nllama-2-70b · {strategy} · {plan.total_params / 1e9:.1f}B params · {format_bytes(plan.total_bytes)}")
    print(f"{'device':<8}{'blocks':>7}{'size':>12}{'budget':>12}{'use':>7}")
    for name, usage in plan.devices.items():
        print(f"{name:<8}{len(usage.modules):>7}{format_bytes(usage.bytes):>12}{format_bytes(usage.budget):>12}"
              f"{usage.share:>7.1%}")
    for run in plan.runs:
        print("  ", run)

try:
    devmap.plan("llama-2-70b", "balanced", max_memory={0: "24GiB", 1: "24GiB"}, dtype="bf16")
except devmap.DoesNotFitError as error:
    print("\nOn two 24 GiB GPUs:", error)
