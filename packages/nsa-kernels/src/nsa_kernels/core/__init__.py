"""The fused attention core: every NSA step after compression in one ``attention_core`` backend.

nsa-core's attention core (:mod:`nsa_core.core`) is one registry op; its reference composes the
step ops one by one. This backend runs the same steps on the kernels the registry picks for each
and owns every hand-off between them that those kernels share (:mod:`nsa_kernels.core.plan`):

- the compressed branch's log-sum-exp reaches block scoring, which skips its normaliser pass;
- the cuDNN compressed branch's output reaches the selected launch as runs of rows, in place;
- the Triton sliding kernel hands the selected one each row's softmax over its forced blocks;
- the selected launch sums the gated combine of the three branches;
- the three branches' gradients of q meet in one summing pass.

| file | role |
|---|---|
| ``backends.py`` | when the fused core serves, its registry row |
| ``plan.py`` | which kernel runs each step of a call, and which hand-offs apply |
| ``fused.py`` | the core itself: the steps in order, with the plan's hand-offs |
| ``fan_out.py`` | q's three views, whose gradients are summed in one pass |
"""
