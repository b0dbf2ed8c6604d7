"""One rank of the Megatron parallel-state tests (run by test_megatron_parallel.py, gloo on the CPU).

    python tests/megatron/_megatron_ep_worker.py OUT_DIR EP IMPL MOE_LAYER_FREQ   (RANK, WORLD_SIZE,
        MASTER_ADDR/PORT set)

As Megatron-LM does with ``--spec megatron_moe.megatron.spec layer_spec --num-experts 8
--expert-model-parallel-size EP``: megatron-core's parallel state with that expert-model-parallel
size, a tiny GPT from our spec and Megatron's MoE flags built from the same seed on every rank,
megatron-core's forward_step / backward_step over this rank's micro-batches of a fixed global
batch (one rank: all of them, the EP = 1 reference), the gradients reduced over the groups
megatron-core's DDP reads (its ``finish_grad_sync``, inside megatron-core's
``finalize_model_grads``, which also updates the expert biases), the gradient 1-norm with
megatron-core's ``get_grad_norm_fp32`` over the groups its optimizer reads, the expert shards of
the distributed-checkpoint state dict (megatron-core's sharding validation run on it). Saves what
the test compares.
"""
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

MICRO_BATCHES, MICRO_BATCH, SEQ = 8, 2, 8  # 8: a micro-batch for each of up to 8 data-parallel ranks
FLAGS = dict(num_moe_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01,
             moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def micro_batch(i: int, vocab: int):
    g = torch.Generator().manual_seed(100 + i)
    tokens = torch.randint(0, vocab, (MICRO_BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ)[None].expand(MICRO_BATCH, -1), torch.roll(tokens, -1, dims=1)


def ddp_reduce(model, config):
    """What megatron-core's DistributedDataParallel does to the gradients (average_in_collective
    off): scale by 1 / data-parallel size, then sum params marked ``allreduce`` (default True) over
    the data-parallel group and the others (experts) over the expert-data-parallel group."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.setup_process_groups_for_ddp(None, config, DistributedDataParallelConfig())
    scale = 1.0 / groups["dp_cp_group"].size()
    for p in model.parameters():
        group = groups["intra_dp_cp_group"] if getattr(p, "allreduce", True) else groups["intra_expt_dp_group"]
        p.grad.mul_(scale)
        dist.all_reduce(p.grad, group=group)


def grad_norm_1(model):
    """The gradient 1-norm as megatron-core's optimizers count it: param groups split by
    ``is_expert_parallel``; the dense optimizer reduces over the model-parallel group, the expert
    one over the expert-tensor-model-pipeline group (get_megatron_optimizer); the norms add up
    (p = 1: get_grad_norm_fp32's 2-norm path allocates on CUDA)."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import param_is_not_shared

    groups = ProcessGroupCollection.setup_process_groups_for_optimizer(None, [model], use_gloo_process_groups=False)
    total = 0.0
    for expert in (False, True):
        params = [p for g in _get_param_groups([model], OptimizerConfig(lr=1e-3), None)
                  if g["is_expert_parallel"] == expert for p in g["params"]]
        grads = [p.grad for p in params
                 if param_is_not_shared(p) and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)]
        assert len(grads) == len(params)
        if not grads:  # the same on every rank (the marks are)
            continue
        group = groups["expt_tp_pp_group"] if expert else groups["mp_group"]
        total += get_grad_norm_fp32(grads, norm_type=1, grad_stats_parallel_group=group)
    return total


def main():
    out_dir, ep = sys.argv[1], int(sys.argv[2])
    impl, _, splits = sys.argv[3].partition("+")  # e.g. triton_grouped+symmetric: the exchange too
    os.environ["MEGATRON_MOE_OVERRIDES"] = (f"model.moe.mlp_impl={impl} model.moe.block_size=16"
                                            + (f" model.moe.a2a_splits={splits}" if splits else ""))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel import schedules

    from megatron_moe.megatron import moe_layer_spec, moe_layers
    from megatron_moe.megatron.model import transformer_config
    from megatron_moe.megatron.model_config import ModelConfig

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, seq_length=SEQ,
                      vocab_size=64)
    config = dataclasses.replace(transformer_config(cfg), expert_model_parallel_size=ep,
                                 moe_layer_freq=int(sys.argv[4]), **FLAGS)
    torch.manual_seed(1234)  # Megatron-LM seeds every data-parallel rank alike
    model = GPTModel(config=config, transformer_layer_spec=moe_layer_spec(None), vocab_size=cfg.vocab_size,
                     max_sequence_length=SEQ)
    layers = moe_layers(model)
    ep_group = parallel_state.get_expert_model_parallel_group()
    uses_megatron_group = [(m.dispatcher.group is ep_group) if ep > 1 else m.ep_size == 1 for m in layers]
    init = {n: p.detach().clone() for n, p in model.named_parameters()}

    mine = list(range(rank * MICRO_BATCHES // world, (rank + 1) * MICRO_BATCHES // world))
    losses = {}

    def forward_step_func(data_iterator, model):
        i = next(data_iterator)
        tokens, pos, labels = micro_batch(i, cfg.vocab_size)
        loss_BS = model(tokens, pos, attention_mask=None, labels=labels)
        losses[i] = loss_BS.detach()
        return loss_BS, lambda loss_BS: (loss_BS.mean(), {})

    data = iter(mine)
    for _ in mine:
        out, _ = schedules.forward_step(forward_step_func, data, model, len(mine), None, [], config, 1)
        schedules.backward_step(None, out, None, ModelType.encoder_or_decoder, config)
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    sharded = model.sharded_state_dict()  # what Megatron-LM's distributed checkpoints save
    validate_sharding_integrity(determine_global_metadata(sharded)[1])  # main replicas tile each tensor
    shards = [(t.key, t.global_shape, t.global_offset, t.replica_id, t.data.detach().clone())
              for k, t in sharded.items() if ".experts.w" in k]
    model.finish_grad_sync = lambda force_all_reduce=False: ddp_reduce(model, config)
    finalize_model_grads([model])  # DDP's reduction, then megatron-core's expert-bias update
    torch.save(dict(
        losses=losses, local=local, reduced={n: p.grad.clone() for n, p in model.named_parameters()},
        init=init, uses_megatron_group=uses_megatron_group, ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_ranks=dist.get_process_group_ranks(ep_group),
        edp_ranks=dist.get_process_group_ranks(parallel_state.get_expert_data_parallel_group()),
        expert_bias=[m.router.expert_bias.clone() for m in layers],
        counts_cleared=all(m.router.local_tokens_per_expert.abs().sum() == 0 for m in layers),
        marks={n: (getattr(p, "allreduce", True), getattr(p, "expert_parallel", False))
               for n, p in model.named_parameters()},
        grad_norm_1=grad_norm_1(model), shards=shards,
    ), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # every rank done with the group before any tears it down (a gloo teardown aborted once)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
