//! Weights that reach an engine a group of parameters at a time (a ZeRO-3 trainer
//! gathers one decoder layer per group): the sender gathers the next group only once the
//! engine has copied this one and dropped it, so the sender's memory holds one group
//! beyond its own shards, never the whole model.

use tokio::sync::{mpsc, oneshot};

use manta_model::NamedTensors;

/// The groups of one update, in order; the update is whole when the sender closes it.
pub type WeightParts = mpsc::Receiver<WeightPart>;

/// One group of parameters and the answer its sender waits for.
pub struct WeightPart {
    tensors: NamedTensors,
    copied: Copied,
}

/// Tells a part's sender that the part was copied and its tensors dropped. Dropped
/// unanswered, it tells the sender the receiver gave up.
pub struct Copied(oneshot::Sender<()>);

impl Copied {
    pub fn done(self) {
        let _ = self.0.send(());
    }
}

impl WeightPart {
    /// A part of `tensors`, and the receiver its [`Copied`] answers.
    pub fn new(tensors: NamedTensors) -> (Self, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        (
            Self {
                tensors,
                copied: Copied(tx),
            },
            rx,
        )
    }

    /// The tensors and the answer, to be given once they are dropped.
    pub fn into_parts(self) -> (NamedTensors, Copied) {
        (self.tensors, self.copied)
    }
}

/// Every part of `parts` moved to the host and answered as it arrives: for engines that
/// take an update only whole, the sender's device memory still holds one part at a time.
pub async fn collect_on_host(mut parts: WeightParts) -> NamedTensors {
    let mut all = NamedTensors::new();
    while let Some(part) = parts.recv().await {
        let (tensors, copied) = part.into_parts();
        all.extend(
            tensors
                .into_iter()
                .map(|(name, t)| (name, t.to_device(tch::Device::Cpu))),
        );
        copied.done();
    }
    all
}
