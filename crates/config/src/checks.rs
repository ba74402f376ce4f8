//! The value checks that every layer of settings shares: one rule over several keys,
//! the first key that breaks it named in the error with its value.

use std::fmt::Display;
use std::path::Path;

use crate::error::ConfigError;

/// Checks every set value of `values` (key, value) with `ok`; the first that fails is
/// an error naming `key(name)`, the value and `reason`.
pub(crate) fn each<T: Copy + Display>(
    origin: &Path,
    key: &dyn Fn(&str) -> String,
    values: &[(&str, Option<T>)],
    ok: impl Fn(T) -> bool,
    reason: &str,
) -> Result<(), ConfigError> {
    for (name, value) in values {
        if let Some(v) = *value {
            if !ok(v) {
                return Err(ConfigError::invalid(origin, key(name), v, reason));
            }
        }
    }
    Ok(())
}
