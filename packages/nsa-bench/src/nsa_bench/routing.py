"""``nsa-bench routing``: which backend serves each op here, why, and the torch/triton pairing."""

from __future__ import annotations

import argparse

import torch

from nsa_bench.cli_args import head_config, positive_int, seqlen
from nsa_core.registry import OpContext, routing_report
from nsa_core.toggles import get_toggles
from nsa_kernels.pairing import installed_pairing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seq-len", type=seqlen, default=8192, help="tokens of the context (8192 or 8k)"
    )
    parser.add_argument("--heads", type=positive_int, default=64, help="query heads HQ")
    parser.add_argument("--kv-heads", type=positive_int, default=4, help="kv heads H")
    parser.add_argument("--dk", type=positive_int, default=128, help="query/key head dim")
    parser.add_argument("--dv", type=positive_int, default=128, help="value head dim")


def check_arguments(args: argparse.Namespace) -> None:
    head_config(args)


def run(args: argparse.Namespace) -> int:
    print(f"pairing: {installed_pairing()}")
    toggles = get_toggles().env_names()
    print("toggles: " + " ".join(f"{k}={v}" for k, v in toggles.items()))
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.insert(0, torch.device("cuda"))
        major, minor = torch.cuda.get_device_capability()
        print(f"device: {torch.cuda.get_device_name()} (sm_{major}{minor})")
    config = head_config(args)
    for device in devices:
        dtypes = (torch.bfloat16, torch.float32) if device.type == "cuda" else (torch.float32,)
        for dtype in dtypes:
            for requires_grad in (False, True):
                ctx = OpContext.for_config(
                    config,
                    device=device,
                    dtype=dtype,
                    seq_len=args.seq_len,
                    requires_grad=requires_grad,
                )
                mode = "train" if requires_grad else "inference"
                print(
                    f"\n[{device.type} {str(dtype).removeprefix('torch.')} {mode}, "
                    f"T={args.seq_len}, HQ={args.heads}, H={args.kv_heads}, "
                    f"dk={args.dk}, dv={args.dv}]"
                )
                print(routing_report(ctx))
    return 0
