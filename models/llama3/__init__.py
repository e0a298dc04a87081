from models import ModelSpec
from models.llama3 import parallelize
from models.llama3.args import FLAVORS, flavor_args, padded_vocab_size
from models.llama3.hf import hf_adapter
from models.llama3.memory import activation_bytes
from models.llama3.model import Transformer

spec = ModelSpec(
    name="llama3",
    flavors=FLAVORS,
    vocab_size=padded_vocab_size,
    build_args=flavor_args,
    model_cls=Transformer,
    root_tp_plan=parallelize.root_tp_plan,
    block_tp_plan=parallelize.block_tp_plan,
    tp_divisible_sizes=parallelize.tp_divisible_sizes,
    blocks=parallelize.blocks,
    head=parallelize.head,
    fsdp_units=parallelize.fsdp_units,
    hf_adapter=hf_adapter,
    activation_bytes=activation_bytes,
)
