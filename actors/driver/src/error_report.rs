//! How the binaries print an error: each cause once. Wrappers such as ractor's "Actor
//! panicked during startup '…'" (which quotes its cause and then lists it again as its
//! source) and messages that already end with their source's text would otherwise say
//! the same thing two or three times in one line.

/// ractor's wrapper around the error an actor's start returned.
const STARTUP_WRAPPER: &str = "Actor panicked during startup '";

/// `err` and its causes, `: `-separated, with a cause left out when an earlier part
/// already says it.
pub fn render(err: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in err.chain() {
        let text = unwrap_startup(&cause.to_string()).to_string();
        if text.is_empty() || parts.iter().any(|p| p.contains(&text)) {
            continue;
        }
        parts.push(text);
    }
    parts.join(": ")
}

fn unwrap_startup(text: &str) -> &str {
    text.strip_prefix(STARTUP_WRAPPER)
        .and_then(|t| t.strip_suffix('\''))
        .unwrap_or(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("Actor panicked during startup '{0}'")]
    struct Startup(#[source] std::io::Error);

    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "m/model.safetensors: bad header",
        );
        let err = anyhow::Error::new(Startup(io)).context("starting the trainer");
        assert_eq!(
            render(&err),
            "starting the trainer: m/model.safetensors: bad header"
        );
        let missing = std::fs::read("/nonexistent/x").unwrap_err();
        let shown = missing.to_string();
        let err = anyhow::Error::new(missing).context(format!("reading /nonexistent/x: {shown}"));
        assert_eq!(
            render(&err).matches("os error 2").count(),
            1,
            "{}",
            render(&err)
        );
    }
}
