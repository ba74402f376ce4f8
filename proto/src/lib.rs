//! Manta's wire formats. Everything that crosses a process boundary is defined in
//! `proto/*.proto` and generated here; no crate hand-writes wire code.

/// Shared messages: the `Sample` that travels from rollout to trainer.
pub mod common {
    tonic::include_proto!("manta.common");
}

/// The worker daemon's service: spawn, stop and health of actors on a node.
pub mod cluster {
    tonic::include_proto!("manta.cluster");
}

/// The rollout actor's service.
pub mod rollout {
    tonic::include_proto!("manta.rollout");
}

/// The trainer actor's service.
pub mod trainer {
    tonic::include_proto!("manta.trainer");
}

/// The weight-sync actor's service.
pub mod weight_sync {
    tonic::include_proto!("manta.weight_sync");
}

/// TensorBoard's event records (scalar summaries only), for metrics event files.
pub mod tensorboard {
    tonic::include_proto!("tensorboard");
}
