"""Load bitnet.cpp's own TL packing functions (no torch needed) from its converter, for make_tl_files.py.

The converter is utils/convert-hf-to-gguf-bitnet.py of microsoft/BitNet; its TL functions (process_tl1,
preprocess_weights_tl1, preprocess_two_weights_tl2, preprocess_three_weights_tl2, preprocess_weights_tl2,
transform_to_tl1, transform_to_tl2, and the HEAD converter's quantize_to_i2_s) are cut out of the file verbatim
and run here as they are; they read include/kernel_config.ini relative to the working directory, as in
bitnet.cpp. BITNET_SRC is a directory holding utils/convert-hf-to-gguf-bitnet.py (git archive of the commit).
"""
from __future__ import annotations

import ast
import os
from typing import Tuple

import numpy as np

NAMES = ("process_tl1", "preprocess_weights_tl1", "preprocess_two_weights_tl2", "preprocess_three_weights_tl2",
         "preprocess_weights_tl2", "transform_to_tl1", "transform_to_tl2", "quantize_to_i2_s")


def load(converter_path: str) -> dict:
    src = open(converter_path, encoding="utf-8").read()
    tree = ast.parse(src)
    ns = {"np": np, "Tuple": Tuple}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in NAMES:
            code = ast.get_source_segment(src, node)
            exec(compile(code, converter_path, "exec"), ns)  # their code, unchanged
    return ns


def with_config(ns: dict, workdir: str, rows: list[tuple[int, int, int, int, int]]):
    """Write workdir/include/kernel_config.ini as codegen_tl*.py does (rows: M, K, BM, BK, bm) and chdir there."""
    os.makedirs(os.path.join(workdir, "include"), exist_ok=True)
    with open(os.path.join(workdir, "include", "kernel_config.ini"), "w") as f:
        for i, (M, K, BM, BK, bm) in enumerate(rows):
            f.write(f"[Kernels_{i}]\nm = {M}\nk = {K}\nbm = {BM}\nbk = {BK}\nbmm = {bm}\n\n")
    os.chdir(workdir)
