//! Built-in environments for local mode: small, deterministic, and quick to learn.

mod counter;
mod digits;
mod tasks;

use std::sync::Arc;

pub use counter::Counter;
pub use digits::{digits_reward, Digits};

use crate::env::Environment;

/// The built-in environments, `digits` first (so it is the server's default), then `counter`.
pub fn builtin_environments() -> Vec<Arc<dyn Environment>> {
    vec![Arc::new(Digits::default()), Arc::new(Counter::default())]
}
