"""The serve limits the runtime enforces, kept in one place: the engine checks its config against
these, and ddops checks deploy profiles against the same values when it loads them, so a profile the
runtime would refuse is refused before anything is deployed.

Standard library only, with no imports at all: ddops loads this on the control machine, where torch
need not be installed (the package's `__init__` imports nothing either).
"""

MODES = ("ddtree", "dflash", "ar")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
MIN_BLOCK_SIZE = 2        # the root plus at least one draft position
MIN_TREE_BUDGET = 1
MAX_TREE_BUDGET = 1024    # the largest tree the engine sizes its caches and graph buckets for
MAX_RUNNING = 1024        # requests batched at once: a ceiling on the slot pool, far above one GPU's worth
MAX_QUEUE = 100_000       # requests waiting behind them
MIN_MEM_FRACTION = 0.01   # of free device memory for the pools; less holds nothing useful
MAX_LOGPROBS = 20         # most likely tokens returned per token (OpenAI's top_logprobs limit, vLLM's default)
# --tree-policy: each round's tree budget chosen by measured cost and acceptance, or --tree-budget always
TREE_POLICIES = ("cost", "fixed")
FP8_GEMMS = ("auto", "triton")    # --fp8-gemm: Hopper's FP8 GEMM (model/fp8.choose_gemms)
QUANTIZE_METHODS = ("none", "fp8")  # --quantize: fp8 = fine-grained e4m3, 128x128 weight blocks (model/fp8.py)
# the one quantized checkpoint layout the runtime serves (config.json's quantization_config; quantization.py)
FP8_CHECKPOINT = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
FP8_MIN_COMPUTE_CAPABILITY = 8.9    # the first GPUs with FP8 tensor cores (Ada); Hopper is 9.0, Blackwell 10.0/12.0
