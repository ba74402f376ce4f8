//! `counter`: a multi-turn tool-use task with per-step rewards.

use serde_json::{json, Value};

use super::tasks::SplitSizes;
use crate::env::{
    Block, EnvError, Environment, Episode, RejectReason, RunToolOutput, Secrets, Split, ToolOutput,
    ToolSpec, ToolsListing,
};

/// Largest |amount| one `add` accepts; keeps the counter far from overflow.
const MAX_AMOUNT: i64 = 1_000_000;

/// Task `{"start": s, "target": t}`: move the counter from `s` to `t` with `add`, then `submit`.
/// Each `add` that brings the value closer earns 0.1; `submit` earns 1.0 on the target.
#[derive(Debug, Clone)]
pub struct Counter {
    sizes: SplitSizes,
}

impl Default for Counter {
    fn default() -> Self {
        Self {
            sizes: SplitSizes {
                train: 1000,
                test: 100,
            },
        }
    }
}

impl Environment for Counter {
    fn name(&self) -> &str {
        "counter"
    }

    fn splits(&self) -> Vec<Split> {
        self.sizes.splits()
    }

    fn num_tasks(&self, split: &str) -> Result<u64, EnvError> {
        self.sizes.len(split)
    }

    fn task(&self, split: &str, index: u64) -> Result<Value, EnvError> {
        let seed = self.sizes.seed(0xc0_0a7e, split, index)?;
        let start = (seed % 10) as i64;
        // Offsets in -5..=5 without 0, so every task needs at least one add.
        let offset = ((seed >> 16) % 10) as i64 - 5;
        let offset = if offset >= 0 { offset + 1 } else { offset };
        Ok(json!({ "start": start, "target": start + offset }))
    }

    fn tools(&self) -> ToolsListing {
        ToolsListing {
            tools: vec![
                ToolSpec {
                    name: "add".to_string(),
                    description: "Add an integer (may be negative) to the counter.".to_string(),
                    input_schema: Some(json!({
                        "type": "object",
                        "properties": { "amount": { "type": "integer", "title": "Amount" } },
                        "required": ["amount"],
                        "title": "AddInput",
                    })),
                },
                ToolSpec {
                    name: "submit".to_string(),
                    description: "Submit the counter's current value; ends the episode."
                        .to_string(),
                    input_schema: None,
                },
            ],
            terminal_tool: None,
        }
    }

    fn new_episode(&self, task_spec: &Value, _: &Secrets) -> Result<Box<dyn Episode>, EnvError> {
        let field = |key: &str| {
            task_spec.get(key).and_then(Value::as_i64).ok_or_else(|| {
                EnvError::InvalidTask(format!(
                    "counter needs integer {key:?} in the task spec, got {task_spec}"
                ))
            })
        };
        let (start, target) = (field("start")?, field("target")?);
        if start.abs() > MAX_AMOUNT || target.abs() > MAX_AMOUNT {
            return Err(EnvError::InvalidTask(format!(
                "counter start/target must be within ±{MAX_AMOUNT}, got {task_spec}"
            )));
        }
        Ok(Box::new(CounterEpisode {
            start,
            target,
            value: start,
            finished: false,
        }))
    }
}

struct CounterEpisode {
    start: i64,
    target: i64,
    value: i64,
    finished: bool,
}

impl CounterEpisode {
    fn add(&mut self, input: &Value) -> RunToolOutput {
        let amount = match input.get("amount") {
            Some(v) => v.as_i64(),
            None => {
                return RunToolOutput::rejected(
                    RejectReason::InputValidation,
                    "Tool input validation error: field `amount` is required",
                )
            }
        };
        let Some(amount) = amount.filter(|a| a.abs() <= MAX_AMOUNT) else {
            return RunToolOutput::rejected(
                RejectReason::InputValidation,
                format!(
                    "Tool input validation error: `amount` must be an integer within ±{MAX_AMOUNT}, got {}",
                    input["amount"]
                ),
            );
        };
        let before = (self.value - self.target).abs();
        self.value += amount;
        let after = (self.value - self.target).abs();
        RunToolOutput::Ok(ToolOutput {
            blocks: vec![Block::text(format!("value is now {}", self.value))],
            metadata: Some(json!({ "value": self.value })),
            reward: Some(if after < before { 0.1 } else { 0.0 }),
            finished: false,
        })
    }

    fn submit(&mut self) -> RunToolOutput {
        self.finished = true;
        let hit = self.value == self.target;
        RunToolOutput::Ok(ToolOutput {
            blocks: vec![Block::text(if hit {
                format!("Correct: the value is {}.", self.value)
            } else {
                format!(
                    "Incorrect: the value is {}, the target was {}.",
                    self.value, self.target
                )
            })],
            metadata: Some(json!({ "value": self.value, "target": self.target })),
            reward: Some(if hit { 1.0 } else { 0.0 }),
            finished: true,
        })
    }
}

impl Episode for CounterEpisode {
    fn prompt(&self) -> Vec<Block> {
        vec![Block::text(format!(
            "A counter starts at {}. Use the `add` tool to change it until it equals {}, then call `submit`.",
            self.start, self.target
        ))]
    }

    fn call(&mut self, name: &str, input: &Value) -> RunToolOutput {
        if name != "add" && name != "submit" {
            return RunToolOutput::rejected(
                RejectReason::NotFound,
                format!("{name:?} is not a valid tool"),
            );
        }
        if self.finished {
            return RunToolOutput::rejected(
                RejectReason::EpisodeFinished,
                format!("{name:?} was not run: the episode has finished"),
            );
        }
        if name == "add" {
            self.add(input)
        } else {
            self.submit()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_need_at_least_one_step() {
        let env = Counter::default();
        let tasks = env.tasks("train").expect("train tasks");
        assert_eq!(tasks.len(), 1000);
        for t in &tasks {
            let (s, g) = (t["start"].as_i64(), t["target"].as_i64());
            assert!(s.is_some() && g.is_some() && s != g, "bad task {t}");
            let d = (g.unwrap_or(0) - s.unwrap_or(0)).abs();
            assert!((1..=5).contains(&d), "bad task {t}");
        }
    }
}
