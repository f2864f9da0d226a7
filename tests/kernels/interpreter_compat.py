"""What the interpreter test scripts (run as ``python -c`` under ``TRITON_INTERPRET=1``) start with.

triton 3.6's interpreter takes ``int()`` of 1-element arrays for runtime loop bounds, which numpy >= 2.4
refuses; :data:`LOOP_BOUNDS` patches that one attribute of the interpreter's tensors.
"""

import textwrap

LOOP_BOUNDS = textwrap.dedent(
    """
    import numpy as np
    from triton.runtime import interpreter as _ti

    _orig_patch = _ti._patch_lang_tensor

    def _patch(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    _ti._patch_lang_tensor = _patch
    """
)
