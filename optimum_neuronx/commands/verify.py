"""`optimum-cli neuron verify <dir>`: run an exported model and the Transformers reference side by side."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False
    parser.add_argument("artifact_dir", type=Path, help="directory written by `optimum-cli export neuron`")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="tokens to generate (default: up to sequence_length, at most 128)")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", dest="trust_remote_code", action="store_true",
                        help="load the export's compiled graphs (native code) even if it was not exported on this "
                             "machine; without it they are rebuilt here from its config and weights")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest accepted logit difference (default: 1e-3 in fp32; bf16/fp16 report only)")


def run_verify(args: argparse.Namespace) -> int:
    from ..artifacts import ArtifactError
    from ..runtime import NeuronModelForCausalLM
    from ..verification import compare_generation, reference_from_artifact, verification_prompts

    from safetensors import SafetensorError

    from ..artifacts import read_artifact

    try:
        if Path(args.artifact_dir).is_dir():
            read_artifact(args.artifact_dir, check_digests=True)  # every file against its sha256
        compiled = NeuronModelForCausalLM.from_pretrained(args.artifact_dir,
                                                          trust_remote_code=getattr(args, "trust_remote_code", False))
        reference = reference_from_artifact(args.artifact_dir)
    except (ValueError, ArtifactError, OSError, SafetensorError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    nc = compiled.neuron_config
    input_ids, attention_mask = verification_prompts(nc, compiled.config.vocab_size)
    new_tokens = args.max_new_tokens or min(128, nc.sequence_length - input_ids.shape[1])
    print(f"prompts: {input_ids.shape[0]} of lengths {attention_mask.sum(-1).tolist()}, {new_tokens} new tokens")
    result = compare_generation(reference, compiled, input_ids, attention_mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens)
    print(result.summary())
    tolerance = args.tolerance if args.tolerance is not None else (1e-3 if nc.auto_cast_type == "fp32" else None)
    if tolerance is None:
        print(f"{nc.auto_cast_type}: reduced precision, greedy paths may diverge; reported, not judged")
        return 0
    ok = result.max_logit_diff <= tolerance and result.tokens_match
    print("OK" if ok else f"FAILED (tolerance {tolerance:g})")
    return 0 if ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="optimum-cli neuron verify", description=__doc__)
    add_verify_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    return run_verify(args)


if __name__ == "__main__":
    sys.exit(main())
