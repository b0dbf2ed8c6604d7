"""megatron_moe.kernels: Triton kernels of the dropless MoE (and Gluon ones for Hopper: gluon_*.py),
each with a plain-PyTorch reference.

Installed as ``megatron_moe.kernels`` (setup.py maps this folder there). It depends only on
torch and triton, never on Megatron. The bare name ``kernels`` belongs to an unrelated PyPI
package, so importing this folder under that name is refused.
"""
if __name__ != "megatron_moe.kernels":
    raise ImportError(
        f"this folder is the package 'megatron_moe.kernels', not '{__name__}': "
        "install the project (pip install -e .) and import megatron_moe.kernels"
    )
