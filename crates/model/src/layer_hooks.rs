//! Where parameters sharded over data-parallel ranks (ZeRO-3) get into the decoder:
//! [`CausalLm::forward_backward_hooked`](crate::CausalLm::forward_backward_hooked) and
//! [`CausalLm::forward_hidden_hooked`](crate::CausalLm::forward_hidden_hooked) call a
//! [`LayerHooks`] around each decoder layer, so its owner can all-gather the layer's
//! parameters just before they are read and free them (or reduce-scatter their
//! gradients) as soon as they are not. The embedding, final norm and LM head are the
//! caller's to gather: they are read outside the decoder stack too (log-probs, the loss).
//!
//! The calls, per layer and pass, every rank in the same order:
//! - forward of a recomputed unit (no autograd): `gather`, the layer, `release`;
//! - forward of a kept unit (autograd on): `gather`, the layer — no release, its graph
//!   reads the parameters again in the backward pass;
//! - backward of a unit: `gather` first for a recomputed one (it runs again), then,
//!   once the unit's gradients are complete, `reduce` for each of its layers (last
//!   layer first): the gradients are final and the parameters unused until the next pass.
//!
//! [`NoHooks`] compiles to nothing: the unsharded paths are unchanged.

/// Called around each decoder layer by the hooked passes (see the module doc).
pub trait LayerHooks {
    type Error;
    /// Layer `layer`'s parameters must hold their full values from now on.
    fn gather(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// Layer `layer`'s forward is done and no backward will read its parameters.
    fn release(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// Layer `layer`'s backward is done: its parameters' `.grad` hold this pass's
    /// gradients (or are undefined: no gradient reached them).
    fn reduce(&mut self, layer: usize) -> Result<(), Self::Error>;
}

/// Whole parameters, nothing to do.
pub struct NoHooks;

impl LayerHooks for NoHooks {
    type Error = std::convert::Infallible;

    #[inline(always)]
    fn gather(&mut self, _layer: usize) -> Result<(), Self::Error> {
        Ok(())
    }

    #[inline(always)]
    fn release(&mut self, _layer: usize) -> Result<(), Self::Error> {
        Ok(())
    }

    #[inline(always)]
    fn reduce(&mut self, _layer: usize) -> Result<(), Self::Error> {
        Ok(())
    }
}
