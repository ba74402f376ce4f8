//! ORS load: many scripted episodes at once through Manta's ORS client (the path the
//! rollout actor uses), against any ORS server. Per episode: open a session, list its
//! tools, read the prompt, `add 1`, `add 1`, `answer` (reward 1), close. Every episode
//! that fails any step, or does not end finished with reward 1, counts as an error.
//! Prints one JSON object with per-call wall times keyed by session id; bench/py joins
//! them with the server's own timings (bench/run_ors_load.sh).
//!
//! The last step is the listing's terminal tool with the target as its argument, or a
//! `submit` tool without arguments when there is no terminal tool (Manta's built-in
//! `counter`). `builtin` instead of a URL serves Manta's built-in environments
//! (`manta_envs::serve`) in this process and runs against that.
//!
//! usage: ors_load BASE_URL|builtin VARIANT EPISODES CONCURRENCY

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use manta_rollout::ors::{Block, OrsClient, OrsClientOptions, ToolResult};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// One finished episode: its session id and (call, client wall ms) in order.
struct Episode {
    sid: String,
    calls: Vec<(&'static str, f64)>,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

async fn episode(ors: OrsClient, env_name: String, task: Value) -> anyhow::Result<Episode> {
    let start = task["start"]
        .as_i64()
        .context("task without integer `start`")?;
    let target = task["target"]
        .as_i64()
        .context("task without integer `target`")?;
    let mut calls = Vec::with_capacity(7);

    let t = Instant::now();
    let session = ors.open_session(&env_name, &task).await?;
    calls.push(("open", ms(t)));
    let sid = session.sid().to_string();

    let t = Instant::now();
    let tools = session.tools().await?;
    calls.push(("tools", ms(t)));
    let last_step = match &tools.terminal_tool {
        Some(t) => {
            let input = match &t.arg {
                Some(arg) => json!({ arg.as_str(): target.to_string() }),
                None => json!({}),
            };
            (t.name.clone(), input)
        }
        None if tools.tools.iter().any(|t| t.name == "submit") => ("submit".into(), json!({})),
        None => bail!("{sid}: no terminal tool and no `submit` in {tools:?}"),
    };
    if !tools.tools.iter().any(|t| t.name == "add") {
        bail!("{sid}: no `add` tool in {tools:?}");
    }

    let t = Instant::now();
    let prompt = session.prompt().await?;
    calls.push(("prompt", ms(t)));
    if !matches!(prompt.first(), Some(Block::Text { .. })) {
        bail!("{sid}: prompt without text: {prompt:?}");
    }

    let steps = [
        ("add".to_string(), json!({ "amount": 1 })),
        ("add".to_string(), json!({ "amount": target - start - 1 })),
        last_step,
    ];
    let mut last = None;
    for (name, input) in steps {
        let t = Instant::now();
        let result = session.call(&name, input).await?;
        calls.push(("call", ms(t)));
        match result {
            ToolResult::Ok {
                reward, finished, ..
            } => last = Some((reward, finished)),
            ToolResult::Rejected { error, reason } => {
                bail!("{sid}: {name} rejected ({reason:?}): {error}")
            }
        }
    }
    if last != Some((Some(1.0), true)) {
        bail!("{sid}: episode ended with (reward, finished) = {last:?}, expected (1.0, true)");
    }

    let t = Instant::now();
    session.close().await?;
    calls.push(("close", ms(t)));
    Ok(Episode { sid, calls })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        bail!("usage: ors_load BASE_URL|builtin VARIANT EPISODES CONCURRENCY");
    }
    let episodes: usize = args[3]
        .parse()
        .with_context(|| format!("EPISODES {:?} is not a count", args[3]))?;
    let concurrency: usize = args[4]
        .parse()
        .with_context(|| format!("CONCURRENCY {:?} is not a count", args[4]))?;
    // Kept alive until the end of main when serving the built-in environments.
    let (_builtin, base_url) = if args[1] == "builtin" {
        let addr = "127.0.0.1:0".parse().context("loopback address")?;
        let server = manta_envs::serve(addr, manta_envs::builtin_environments()).await?;
        let url = server.base_url();
        (Some(server), url)
    } else {
        (None, args[1].clone())
    };
    let ors = OrsClient::new(OrsClientOptions {
        variant: Some(args[2].clone()),
        ..OrsClientOptions::new(&base_url)
    })?;
    // Setup, not timed: the task list.
    let list = ors.list_tasks("train").await?;
    if list.tasks.is_empty() {
        bail!("split `train` of {base_url} has no tasks");
    }

    let gate = Arc::new(Semaphore::new(concurrency));
    let mut set = JoinSet::new();
    let t0 = Instant::now();
    for i in 0..episodes {
        let (ors, gate) = (ors.clone(), gate.clone());
        let env_name = list.env_name.clone();
        let task = list.tasks[i % list.tasks.len()].clone();
        set.spawn(async move {
            let _permit = gate.acquire_owned().await?;
            episode(ors, env_name, task).await
        });
    }
    let mut done = Vec::with_capacity(episodes);
    let mut errors = Vec::new();
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok(Ok(ep)) => done.push(ep),
            Ok(Err(e)) => errors.push(format!("{e:#}")),
            Err(e) => errors.push(format!("episode task failed: {e}")),
        }
    }
    let wall = t0.elapsed().as_secs_f64();

    let sessions: serde_json::Map<String, Value> = done
        .iter()
        .map(|ep| (ep.sid.clone(), json!(ep.calls)))
        .collect();
    let out = json!({
        "client": "manta-rollout OrsClient (Rust, tokio)",
        "server": if args[1] == "builtin" { "manta-envs built-in server, same process" } else { "external" },
        "episodes": episodes,
        "concurrency": concurrency,
        "errors": errors.len(),
        "error_samples": errors.iter().take(5).collect::<Vec<_>>(),
        "wall_s": wall,
        "episodes_per_s": done.len() as f64 / wall,
        "sessions": sessions,
    });
    println!("{out}");
    Ok(())
}
