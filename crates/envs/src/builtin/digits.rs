//! `digits`: a single-turn task a tiny model learns quickly: reply with a given digit.

use serde_json::{json, Value};

use super::tasks::SplitSizes;
use crate::env::{
    Block, EnvError, Environment, Episode, RejectReason, RunToolOutput, Secrets, Split,
    TerminalTool, ToolOutput, ToolsListing,
};

const TERMINAL: &str = "answer";

/// Task `{"target": d}`; the prompt asks for digit `d`; the plain assistant message is the
/// answer (terminal tool `answer`). Partial credit (0.5 per other digit) gives GRPO a slope.
#[derive(Debug, Clone)]
pub struct Digits {
    sizes: SplitSizes,
}

impl Default for Digits {
    fn default() -> Self {
        Self {
            sizes: SplitSizes {
                train: 1000,
                test: 100,
            },
        }
    }
}

/// Reward of an answer for `target`: mean per character of 1.0 (the target digit), 0.5 (any
/// other ASCII digit) or 0.0; an empty (after trimming) answer scores 0.0.
pub fn digits_reward(answer: &str, target: u32) -> f64 {
    let answer = answer.trim();
    if answer.is_empty() {
        return 0.0;
    }
    let target = char::from_digit(target, 10);
    let mut total = 0.0;
    let mut count = 0usize;
    for c in answer.chars() {
        count += 1;
        total += if Some(c) == target {
            1.0
        } else if c.is_ascii_digit() {
            0.5
        } else {
            0.0
        };
    }
    total / count as f64
}

impl Environment for Digits {
    fn name(&self) -> &str {
        "digits"
    }

    fn splits(&self) -> Vec<Split> {
        self.sizes.splits()
    }

    fn num_tasks(&self, split: &str) -> Result<u64, EnvError> {
        self.sizes.len(split)
    }

    fn task(&self, split: &str, index: u64) -> Result<Value, EnvError> {
        let seed = self.sizes.seed(0xd161_7500, split, index)?;
        Ok(json!({ "target": seed % 10 }))
    }

    fn tools(&self) -> ToolsListing {
        ToolsListing {
            tools: Vec::new(),
            terminal_tool: Some(TerminalTool {
                name: TERMINAL.to_string(),
                arg: Some("answer".to_string()),
                description: "Your final answer.".to_string(),
            }),
        }
    }

    fn new_episode(&self, task_spec: &Value, _: &Secrets) -> Result<Box<dyn Episode>, EnvError> {
        let target = task_spec
            .get("target")
            .and_then(Value::as_u64)
            .filter(|d| *d < 10)
            .ok_or_else(|| {
                EnvError::InvalidTask(format!(
                    "digits needs {{\"target\": 0..9}}, got {task_spec}"
                ))
            })?;
        Ok(Box::new(DigitsEpisode {
            target: target as u32,
            finished: false,
        }))
    }
}

struct DigitsEpisode {
    target: u32,
    finished: bool,
}

impl Episode for DigitsEpisode {
    fn prompt(&self) -> Vec<Block> {
        vec![Block::text(format!(
            "Reply with the digit {}.",
            self.target
        ))]
    }

    fn call(&mut self, name: &str, input: &Value) -> RunToolOutput {
        if name != TERMINAL {
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
        let Some(answer) = input.get("answer").and_then(Value::as_str) else {
            return RunToolOutput::rejected(
                RejectReason::InputValidation,
                format!("Tool input validation error: `answer` must be a string, got {input}"),
            );
        };
        self.finished = true;
        let reward = digits_reward(answer, self.target);
        RunToolOutput::Ok(ToolOutput {
            blocks: vec![Block::text(format!(
                "The target was {}; reward {reward}.",
                self.target
            ))],
            metadata: Some(json!({ "target": self.target })),
            reward: Some(reward),
            finished: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reward_counts_matching_and_other_digits() {
        assert_eq!(digits_reward(" 7\n", 7), 1.0);
        assert_eq!(digits_reward("3", 7), 0.5);
        assert_eq!(digits_reward("7a", 7), 0.5);
        assert_eq!(digits_reward("73", 7), 0.75);
        assert_eq!(digits_reward("   ", 7), 0.0);
        assert_eq!(digits_reward("seven", 7), 0.0);
    }

    #[test]
    fn tasks_are_deterministic_and_cover_all_digits() {
        let env = Digits::default();
        let a: Vec<Value> = env.tasks("train").expect("train tasks");
        let b: Vec<Value> = env.tasks("train").expect("train tasks");
        assert_eq!(a.len(), 1000);
        assert_eq!(a, b);
        for d in 0..10u64 {
            assert!(a.iter().any(|t| t["target"] == d), "digit {d} never drawn");
        }
        assert_ne!(env.tasks("test").expect("test tasks")[..10], a[..10]);
        assert!(matches!(
            env.task("train", 1000),
            Err(EnvError::IndexOutOfRange { .. })
        ));
    }
}
