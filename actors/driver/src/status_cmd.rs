//! `driver status`: asks a running driver's status endpoint (crate::status_server) and
//! prints what it answers.

use std::time::Duration;

use anyhow::Context;

use crate::cli::StatusArgs;
use crate::status::{render, Snapshot};

/// The summary (or JSON) of the driver that `args` names.
pub async fn status(args: &StatusArgs) -> anyhow::Result<String> {
    let addr = match (&args.addr, &args.run_dir) {
        (Some(addr), _) => addr.clone(),
        (None, Some(dir)) => {
            let file = dir.join(crate::status_server::ADDR_FILE);
            std::fs::read_to_string(&file)
                .with_context(|| {
                    format!(
                        "--run-dir {}: no {} (is a driver running this run?)",
                        dir.display(),
                        crate::status_server::ADDR_FILE
                    )
                })?
                .trim()
                .to_string()
        }
        (None, None) => anyhow::bail!("pass --addr HOST:PORT or --run-dir DIR"),
    };
    let url = format!("http://{addr}/status");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let reply = client
        .get(&url)
        .send()
        .await
        .with_context(|| format!("asking {url} (is the driver running?)"))?;
    let code = reply.status();
    let body = reply
        .text()
        .await
        .with_context(|| format!("reading the answer of {url}"))?;
    if !code.is_success() {
        anyhow::bail!("{url} answered {code}: {}", body.trim());
    }
    if args.json {
        return Ok(body);
    }
    let snapshot: Snapshot = serde_json::from_str(&body)
        .with_context(|| format!("{url} answered something that is not a driver's status"))?;
    Ok(render(&snapshot))
}
