"""dflash-trt: take a target LLM and its DFlash drafter to production on NVIDIA GPUs.

    from dflash_trt import load_pair, generate
    pair = load_pair("target_dir", "drafter_dir")
    print(generate(pair, "Write a haiku", max_new_tokens=64).text)
"""
__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import dflash_trt` must not pull in torch
    if name in ("load_pair", "generate", "encode_prompt"):
        from dflash_trt.runtime import pair as api
        return getattr(api, name)
    raise AttributeError(name)
