"""One training run of tests/training/test_train.py's one-expert-equals-dense test.

    python tests/training/_one_expert_worker.py dense|moe INIT_PT [hook flags] -- TRAIN_ARGS...

Runs ``megatron_moe.training.train.main(TRAIN_ARGS)`` with ``build_gpt_model`` wrapped:
  dense: after building, the dense MLPs' biases are removed (our experts have none), and the
         initial state dict is saved to INIT_PT;
  moe:   the model (one expert, top-1) starts from INIT_PT: every shared parameter copied, and
         experts.w1[0] = linear_fc1.weight.T, experts.w2[0] = linear_fc2.weight.T.
A softmax over one expert is exactly 1, so the two models compute the same function, and the
runs must log the same losses and gradient norms step for step.
"""
import sys

import torch

import megatron_moe.training.train as train
from _hooked_train import apply_hooks


def _patched(mode: str, init_path: str):
    build = train.build_gpt_model

    def build_gpt_model(model_cfg):
        model = build(model_cfg)
        mlps = [layer.mlp for layer in model.decoder.layers]
        with torch.no_grad():
            if mode == "dense":
                for mlp in mlps:
                    for lin in (mlp.dense.linear_fc1, mlp.dense.linear_fc2):
                        lin.bias = None
                torch.save(model.state_dict(), init_path)
                return model
            state = torch.load(init_path, weights_only=True)
            own = model.state_dict()
            shared = [n for n, t in state.items() if torch.is_tensor(t) and ".mlp.dense." not in n]
            assert shared and all(torch.is_tensor(own.get(n)) for n in shared), "the models differ"
            for name in shared:
                own[name].copy_(state[name])
            for i, mlp in enumerate(mlps):
                prefix = f"decoder.layers.{i}.mlp.dense."
                mlp.moe.experts.w1[0].copy_(state[prefix + "linear_fc1.weight"].t())
                mlp.moe.experts.w2[0].copy_(state[prefix + "linear_fc2.weight"].t())
        return model

    return build_gpt_model


if __name__ == "__main__":
    mode, init_path, *rest = sys.argv[1:]
    assert mode in ("dense", "moe"), sys.argv
    args = apply_hooks(rest)
    train.build_gpt_model = _patched(mode, init_path)
    sys.exit(train.main(args))
