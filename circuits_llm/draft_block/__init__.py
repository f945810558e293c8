"""A draft that reads the context: FastMTP's MTP block (issue 44), beside the circuit heads.

:mod:`~circuits_llm.draft_block.block` (:class:`DraftBlock`: one or ``L`` decoder layers of the
target's shape over ``W [rms(h); rms(E[x])]``, the target's final norm and compressed LM head);
:mod:`~circuits_llm.draft_block.drafter` (:class:`BlockDrafter`: recursive drafting with its own KV
cache, which follows the verifier's; what :class:`~circuits_llm.decoding.decoder.SpeculativeDecoder`
takes in place of a head); :mod:`~circuits_llm.draft_block.training` (the loss over depths, where
later depths read the block's own outputs, and a training loop on cached prefill features);
:mod:`~circuits_llm.draft_block.circuit_drafter` (:class:`BlockCircuitDrafter`: the block run once
per round, its output read by any circuit head that drafts the whole window with its exact joint
law; :func:`circuits_llm.training.block_circuit.train_block_head` trains such a head with the MTP
loss on the frozen block's outputs);
:mod:`~circuits_llm.draft_block.follower` (:class:`BlockCacheFollower`: the block's KV cache of
one sequence, kept in step with the verifier's, which both drafters share);
:mod:`~circuits_llm.draft_block.batch_depth` (:class:`BatchDepth`: the recursion's depth in a
batch); :mod:`~circuits_llm.draft_block.step` (:class:`BlockStep`: the block's decode step over a
preallocated KV cache of one sequence, eager or compiled, which the drafters run);
:mod:`~circuits_llm.draft_block.weights` (:class:`DraftWeights`: the block's projections held as
trained or in int8 while drafting); :mod:`~circuits_llm.draft_block.io`
(:func:`save_draft_block` / :func:`load_draft_block`: the block's own weights and a checked
config, refused for another model). ``train-head --draft-block``
(:mod:`circuits_llm.training.block_trainer`) trains one in the head-training loop.
"""

from circuits_llm.draft_block.batch_depth import BatchDepth
from circuits_llm.draft_block.block import BlockInit, DraftBlock, DraftBlockError
from circuits_llm.draft_block.circuit_drafter import BlockCircuitDrafter, BlockCircuitRoundProgram
from circuits_llm.draft_block.drafter import BlockDrafter, BlockRoundProgram
from circuits_llm.draft_block.follower import BlockCacheFollower
from circuits_llm.draft_block.io import DraftBlockFileError, load_draft_block, save_draft_block
from circuits_llm.draft_block.step import BlockKVCache, BlockStep, BlockStepMode
from circuits_llm.draft_block.weights import DraftWeights

__all__ = ["BatchDepth", "BlockCacheFollower", "BlockCircuitDrafter", "BlockCircuitRoundProgram",
           "BlockDrafter", "BlockInit", "BlockKVCache", "BlockRoundProgram", "BlockStep",
           "BlockStepMode", "DraftBlock", "DraftBlockError", "DraftBlockFileError", "DraftWeights",
           "load_draft_block", "save_draft_block"]
