"""Print, as markdown, which SGLang target families the CPU tests cover for EAGLE-3 capture and which
were tried and are not (with the exact reason): ``python tests/sglang/families_table.py``. The rows
live next to the tests (test_target_capture_wrappers_and_families.py: COVERED, NOT_COVERED) and the
families of the older test files are listed here."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the families test_target_capture.py, test_target_capture_more_families.py and test_deepseek_packer.py cover
OLDER = [
    ("Llama, Qwen2, Qwen3, Qwen3-MoE, GLM-4.5/4.6", "test_target_capture.py", "HF", "fp32, bf16"),
    ("gpt-oss (boundary L at the final norm)", "test_target_capture_more_families.py", "HF", "fp32, bf16"),
    ("DeepSeek-V2 (AuxHiddenStatePacker)", "test_deepseek_packer.py", "HF", "fp32, bf16"),
]


def main() -> None:
    import test_target_capture_wrappers_and_families as t

    print("| family | SGLang class | capture owner | reference | dtype | test |")
    print("|---|---|---|---|---|---|")
    for family, where, ref, dtype in OLDER:
        print(f"| {family} | | | {ref} | {dtype} | {where} |")
    for test, (family, cls, owner, ref, dtype) in t.COVERED.items():
        print(f"| {family} | `{cls}` | {owner} | {ref} | {dtype} | {os.path.basename(t.__file__)}::{test} |")
    print()
    print("| not covered | why (SGLang 0.5.23 on a CPU) |")
    print("|---|---|")
    for family, why in t.NOT_COVERED.items():
        print(f"| {family} | {why} |")


if __name__ == "__main__":
    main()
