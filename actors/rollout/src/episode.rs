//! One episode against an ORS environment: the cookbook's generate function with
//! Manta's fixes (REFERENCE.md §1): token-level accounting, malformed tool calls as
//! error turns, terminal-tool answers, budgets, per-step rewards.

use std::sync::Arc;

use manta_config::{format_system_prompt, EnvironmentConfig};
use manta_core::pyjson::dumps_default as dumps;
use manta_core::{EpisodeMetadata, Sample, SampleStatus};
use serde_json::{json, Map, Value};
use tracing::field::Empty;
use tracing::{debug, info_span, warn, Instrument};

use crate::chat::ChatFormat;
use crate::ors::{Block, OrsClient, OrsSession, ToolResult, ToolsListing};
use crate::tool_call::{parse_tool_call, ParsedTurn, TOOL_CALL_OPEN};
use crate::upload::{Message, MessageType, RolloutInfo, RolloutRecorder, Uploader};
use manta_engine::{Engine, FinishReason, GenerateRequest, SamplingParams};

/// The user message sent when a turn has no tool call and the environment has no terminal tool.
pub const NO_TOOL_CALL_MESSAGE: &str =
    "No tool call detected. Please use the provided tools to complete the task.";

/// A task to run, as drawn from tasks.jsonl or listed from the server.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRef {
    /// `Owner/Name`, the key in train_config.yaml.
    pub environment: String,
    pub split: String,
    pub task_spec: Value,
    pub task_hash: String,
    /// The environment's name on its server (what task listings return as `env_name`).
    pub server_env: String,
}

/// Which sample of which group this episode produces.
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodeRequest {
    pub sample_id: u64,
    pub group_index: u32,
    pub index: u32,
    pub task: TaskRef,
}

/// Generation limits for a batch of episodes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerationSettings {
    pub temperature: f64,
    /// Nucleus sampling (1.0: off), as SGLang's `top_p`.
    pub top_p: f64,
    /// The k most likely tokens only (-1: off), as SGLang's `top_k`.
    pub top_k: i64,
    /// Most tokens per generate call.
    pub max_response_len: usize,
    /// Whole-episode budget (prompt + all turns).
    pub context_len: usize,
    /// `--partial-rollout`: a generate call that a weight update aborted goes on from
    /// its partial output with the new weights, instead of ending the episode as
    /// `Aborted`.
    pub partial_rollout: bool,
    /// `--use-rollout-routing-replay`: ask the engine for each token's routed experts
    /// and keep them on the sample.
    pub return_routed_experts: bool,
}

/// Most times one turn's generation is resumed after an abort (a guard against an
/// engine that aborts every request).
const MAX_RESUMES_PER_TURN: usize = 64;

/// An environment as the episode loop sees it: its client and its options.
pub struct EnvironmentHandle {
    pub name: String,
    pub client: OrsClient,
    pub config: EnvironmentConfig,
}

/// What every episode of a rollout actor shares.
pub struct EpisodeContext {
    pub engine: Arc<dyn Engine>,
    pub chat: ChatFormat,
    pub system_prompt_template: String,
    /// Token ids that end a generate call (`<|im_end|>`, `</tool_call>`, EOS).
    pub stop_token_ids: Vec<u32>,
    /// Where transcripts go (OpenReward's rollout viewer); `None` records nothing.
    pub upload: Option<Uploader>,
}

/// The system prompt's `{tools}`: one JSON object per line with the cookbook's key
/// order and Python `json.dumps` separators.
pub fn tools_text(tools: &ToolsListing) -> String {
    tools
        .tools
        .iter()
        .map(|t| {
            let schema = t.input_schema.clone().unwrap_or(Value::Null);
            format!(
                "{{\"name\": {}, \"arguments_schema\": {}, \"description\": {}}}",
                dumps(&Value::String(t.name.clone())),
                dumps(&schema),
                dumps(&Value::String(t.description.clone()))
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Concatenates the prompt's text blocks; images are dropped (as the cookbook does).
pub fn prompt_text(blocks: &[Block]) -> String {
    blocks
        .iter()
        .filter_map(|b| match b {
            Block::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn blocks_text(blocks: &[Block]) -> String {
    prompt_text(blocks)
}

/// Running state of one episode's token sequence.
struct Trajectory {
    prompt: Vec<u32>,
    response: Vec<u32>,
    loss_mask: Vec<u8>,
    logprobs: Vec<f32>,
    /// Weight version behind each response token.
    versions: Vec<u64>,
    /// The engine's version when the episode started (the sample's version when it
    /// generated nothing).
    weight_version: u64,
    /// The last generate call's routed experts: it ran the whole sequence so far.
    routed_experts: Option<manta_core::RoutedExperts>,
}

impl Trajectory {
    fn len(&self) -> usize {
        self.prompt.len() + self.response.len()
    }
    fn push_generated(&mut self, ids: &[u32], logprobs: &[f32], version: u64) {
        self.response.extend_from_slice(ids);
        self.loss_mask.extend(std::iter::repeat_n(1u8, ids.len()));
        self.logprobs.extend_from_slice(logprobs);
        self.versions
            .extend(std::iter::repeat_n(version, ids.len()));
    }
    fn push_context(&mut self, ids: &[u32]) {
        let version = self.versions.last().copied().unwrap_or(self.weight_version);
        self.response.extend_from_slice(ids);
        self.loss_mask.extend(std::iter::repeat_n(0u8, ids.len()));
        self.logprobs.extend(std::iter::repeat_n(0.0f32, ids.len()));
        self.versions
            .extend(std::iter::repeat_n(version, ids.len()));
    }
    /// Of the last `turn_len` response tokens, sets the first `count` to mask 0.
    fn mask_last(&mut self, turn_len: usize, count: usize) {
        let start = self.loss_mask.len().saturating_sub(turn_len);
        let end = (start + count).min(self.loss_mask.len());
        for m in &mut self.loss_mask[start..end] {
            *m = 0;
        }
    }
    /// The oldest version behind any of its tokens.
    fn oldest_version(&self) -> u64 {
        self.versions
            .iter()
            .copied()
            .min()
            .unwrap_or(self.weight_version)
    }
}

/// How the loop ended.
struct Outcome {
    status: SampleStatus,
    stop_reason: &'static str,
    reached_terminal: bool,
    error: Option<String>,
}

/// Runs one episode and returns its sample. Environment or engine failures give a
/// `Failed` sample carrying the error (never a panic, never a stalled step).
pub async fn run_episode(
    ctx: &EpisodeContext,
    env: &EnvironmentHandle,
    request: &EpisodeRequest,
    settings: GenerationSettings,
) -> Sample {
    let span = info_span!(
        "episode",
        env = %env.name,
        task = %request.task.task_hash,
        sample = request.sample_id as i64,
        reward = Empty,
        turns = Empty,
        stop_reason = Empty,
        tokens = Empty
    );
    let recorder = span.clone();
    async {
        let mut meta = EpisodeMetadata {
            environment: env.name.clone(),
            task_hash: request.task.task_hash.clone(),
            ..Default::default()
        };
        let mut traj = Trajectory {
            prompt: Vec::new(),
            response: Vec::new(),
            loss_mask: Vec::new(),
            logprobs: Vec::new(),
            versions: Vec::new(),
            weight_version: ctx.engine.weight_version(),
            routed_experts: None,
        };
        let mut transcript = ctx
            .upload
            .as_ref()
            .map(|u| u.start_rollout(rollout_info(env, request, traj.weight_version)));
        let outcome = match env
            .client
            .open_session(&request.task.server_env, &request.task.task_spec)
            .await
        {
            Ok(session) => {
                let outcome = episode_loop(
                    ctx,
                    env,
                    &session,
                    settings,
                    &mut traj,
                    &mut meta,
                    &mut transcript,
                )
                .await;
                if let Err(e) = session.close().await {
                    warn!(error = %e, "closing ORS session failed");
                }
                outcome
            }
            Err(e) => Outcome {
                status: SampleStatus::Failed,
                stop_reason: "environment_error",
                reached_terminal: false,
                error: Some(format!("opening session: {e}")),
            },
        };
        meta.stop_reason = outcome.stop_reason.to_string();
        meta.error = outcome.error.clone();
        let reward = if outcome.status == SampleStatus::Failed {
            0.0
        } else {
            env.config
                .episode_reward(&meta.step_rewards, outcome.reached_terminal)
        };
        if let Some(err) = &outcome.error {
            warn!(error = %err, "episode failed");
        }
        debug!(
            reward,
            turns = meta.num_turns,
            stop = outcome.stop_reason,
            "episode done"
        );
        let response_length = traj.response.len();
        recorder.record("reward", reward);
        // i64: OpenTelemetry has no unsigned attribute type.
        recorder.record("turns", i64::from(meta.num_turns));
        recorder.record("stop_reason", outcome.stop_reason);
        recorder.record("tokens", (traj.prompt.len() + response_length) as i64);
        let version = traj.oldest_version();
        meta.engine_restarts = ctx.engine.restarts();
        meta.weight_versions = traj.versions;
        let mut tokens = traj.prompt;
        tokens.extend(traj.response);
        Sample {
            id: request.sample_id,
            group_index: request.group_index,
            index: request.index,
            tokens,
            response_length,
            loss_mask: traj.loss_mask,
            rollout_log_probs: traj.logprobs,
            reward,
            status: outcome.status,
            weight_version: version,
            metadata: meta,
            routed_experts: traj.routed_experts,
        }
    }
    .instrument(span)
    .await
}

async fn episode_loop(
    ctx: &EpisodeContext,
    env: &EnvironmentHandle,
    session: &OrsSession,
    settings: GenerationSettings,
    traj: &mut Trajectory,
    meta: &mut EpisodeMetadata,
    transcript: &mut Option<RolloutRecorder>,
) -> Outcome {
    let recording = transcript.is_some();
    let mut log = |message: Message| {
        if let Some(t) = transcript.as_mut() {
            t.log(message);
        }
    };
    let failed = |stop_reason: &'static str, error: String| Outcome {
        status: SampleStatus::Failed,
        stop_reason,
        reached_terminal: false,
        error: Some(error),
    };
    let tools = match session.tools().await {
        Ok(t) => t,
        Err(e) => return failed("environment_error", format!("listing tools: {e}")),
    };
    let user = match session.prompt().await {
        Ok(blocks) => prompt_text(&blocks),
        Err(e) => return failed("environment_error", format!("getting prompt: {e}")),
    };
    let system = match format_system_prompt(&ctx.system_prompt_template, &tools_text(&tools)) {
        Ok(s) => s,
        Err(e) => return failed("config_error", format!("system_prompt_template: {e}")),
    };
    log(Message::new(MessageType::SystemMessage, system.clone()));
    log(Message::new(MessageType::UserMessage, user.clone()));
    traj.prompt = match ctx.chat.prompt_ids(&system, &user) {
        Ok(ids) => ids,
        Err(e) => return failed("template_error", format!("rendering the prompt: {e}")),
    };
    let tokenizer = ctx.chat.tokenizer();
    for turn in 0..env.config.max_turns {
        meta.num_turns = turn as u32 + 1;
        // Lives until the end of this iteration; this turn's generate and tool calls nest in it.
        let turn_span = info_span!("turn", turn = turn as i64);
        let budget = settings.context_len.saturating_sub(traj.len());
        let max_new = settings.max_response_len.min(budget);
        if max_new == 0 {
            return Outcome {
                status: SampleStatus::Truncated,
                stop_reason: "context_budget",
                reached_terminal: false,
                error: None,
            };
        }
        let mut input = traj.prompt.clone();
        input.extend_from_slice(&traj.response);
        let request = GenerateRequest {
            input_ids: input,
            params: SamplingParams {
                max_new_tokens: max_new,
                temperature: settings.temperature,
                top_p: settings.top_p,
                top_k: settings.top_k,
                stop_token_ids: ctx.stop_token_ids.clone(),
                ..SamplingParams::default()
            },
            rid: None,
            return_routed_experts: settings.return_routed_experts,
        };
        let mut out = match ctx
            .engine
            .generate(request)
            .instrument(info_span!(parent: &turn_span, "generate", turn = turn as i64))
            .await
        {
            Ok(out) => out,
            Err(e) => return failed("engine_error", format!("generate: {e}")),
        };
        meta.prefix_cache
            .record(turn, out.prompt_tokens, out.cached_tokens);
        traj.push_generated(&out.output_ids, &out.logprobs, out.weight_version);
        if out.routed_experts.is_some() {
            traj.routed_experts = out.routed_experts.take();
        }
        // A weight update aborted the call: as a partial rollout, go on from the
        // tokens it produced, with the new weights.
        let mut turn_ids = std::mem::take(&mut out.output_ids);
        let mut resumes = 0;
        while out.finish == FinishReason::Abort
            && settings.partial_rollout
            && turn_ids.len() < max_new
            && resumes < MAX_RESUMES_PER_TURN
        {
            resumes += 1;
            let mut input = traj.prompt.clone();
            input.extend_from_slice(&traj.response);
            let request = GenerateRequest {
                input_ids: input,
                params: SamplingParams {
                    max_new_tokens: max_new - turn_ids.len(),
                    temperature: settings.temperature,
                    top_p: settings.top_p,
                    top_k: settings.top_k,
                    stop_token_ids: ctx.stop_token_ids.clone(),
                    ..SamplingParams::default()
                },
                rid: None,
                return_routed_experts: settings.return_routed_experts,
            };
            out = match ctx
                .engine
                .generate(request)
                .instrument(
                    info_span!(parent: &turn_span, "generate", turn = turn as i64, resumed = true),
                )
                .await
            {
                Ok(out) => out,
                Err(e) => return failed("engine_error", format!("generate (resumed): {e}")),
            };
            meta.prefix_cache
                .record(turn, out.prompt_tokens, out.cached_tokens);
            traj.push_generated(&out.output_ids, &out.logprobs, out.weight_version);
            if out.routed_experts.is_some() {
                traj.routed_experts = out.routed_experts.take();
            }
            turn_ids.append(&mut out.output_ids);
        }
        out.output_ids = turn_ids;
        if out.finish == FinishReason::Abort {
            return Outcome {
                status: SampleStatus::Aborted,
                stop_reason: "aborted",
                reached_terminal: false,
                error: None,
            };
        }
        let generated = match tokenizer.decode(&out.output_ids, false) {
            Ok(t) => t,
            Err(e) => return failed("tokenizer_error", format!("decoding output: {e}")),
        };
        if ctx.chat.thinking() {
            // The cookbook trains on the answer only: the thinking tokens of the turn,
            // through `</think>` and the whitespace after it, leave the loss.
            let boundary = thinking_boundary(&generated, out.output_ids.len(), |t| {
                tokenizer.encode(t).map(|ids| ids.len()).unwrap_or(0)
            });
            traj.mask_last(out.output_ids.len(), boundary);
        }
        let budget_hit = out.finish == FinishReason::Length && max_new < settings.max_response_len;
        let parsed = parse_tool_call(&generated);
        if recording {
            for m in assistant_messages(&generated, &parsed) {
                log(m);
            }
        }
        let call_id = format!("call_{turn}");
        let reply_text = match parsed {
            ParsedTurn::Call(call) => {
                meta.num_tool_calls += 1;
                log(tool_call_message(&call.name, &call.arguments, &call_id));
                let result = session
                    .call(&call.name, Value::Object(call.arguments))
                    .instrument(info_span!(parent: &turn_span, "tool_call", turn = turn as i64, tool = %call.name))
                    .await;
                match result {
                    Ok(ToolResult::Ok {
                        blocks,
                        reward,
                        finished,
                        ..
                    }) => {
                        let text = blocks_text(&blocks);
                        log(tool_result_message(&text, reward, finished, &call_id));
                        if let Some(r) = reward {
                            meta.step_rewards.push(r);
                        }
                        if finished {
                            return terminal();
                        }
                        text
                    }
                    Ok(ToolResult::Rejected { error, .. }) => {
                        meta.num_failed_tool_calls += 1;
                        let text = format!("Error: {error}");
                        log(tool_result_message(&text, None, false, &call_id));
                        text
                    }
                    Err(e) => {
                        log(tool_result_message(
                            &format!("Error: {e}"),
                            None,
                            false,
                            &call_id,
                        ));
                        return failed("environment_error", format!("tool {}: {e}", call.name));
                    }
                }
            }
            ParsedTurn::Malformed(reason) => {
                meta.num_tool_calls += 1;
                meta.num_failed_tool_calls += 1;
                let text = format!("Error: malformed tool call: {reason}");
                log(Message::new(MessageType::UserMessage, text.clone()));
                text
            }
            ParsedTurn::NoToolCall => {
                if let Some(terminal_tool) = &tools.terminal_tool {
                    let answer = match tokenizer.decode(&out.output_ids, true) {
                        Ok(t) => t.trim().to_string(),
                        Err(e) => {
                            return failed("tokenizer_error", format!("decoding output: {e}"))
                        }
                    };
                    let mut input = Map::new();
                    if let Some(arg) = &terminal_tool.arg {
                        input.insert(arg.clone(), Value::String(answer));
                    }
                    log(tool_call_message(&terminal_tool.name, &input, &call_id));
                    let result = session
                        .call(&terminal_tool.name, Value::Object(input))
                        .instrument(info_span!(parent: &turn_span, "tool_call", turn = turn as i64, tool = %terminal_tool.name))
                        .await;
                    match result {
                        Ok(ToolResult::Ok {
                            blocks,
                            reward,
                            finished,
                            ..
                        }) => {
                            log(tool_result_message(
                                &blocks_text(&blocks),
                                reward,
                                finished,
                                &call_id,
                            ));
                            if let Some(r) = reward {
                                meta.step_rewards.push(r);
                            }
                            if finished {
                                return terminal();
                            }
                            String::new()
                        }
                        Ok(ToolResult::Rejected { error, .. }) => {
                            meta.num_failed_tool_calls += 1;
                            let text = format!("Error: {error}");
                            log(tool_result_message(&text, None, false, &call_id));
                            text
                        }
                        Err(e) => {
                            log(tool_result_message(
                                &format!("Error: {e}"),
                                None,
                                false,
                                &call_id,
                            ));
                            return failed(
                                "environment_error",
                                format!("terminal tool {}: {e}", terminal_tool.name),
                            );
                        }
                    }
                } else {
                    log(Message::new(MessageType::UserMessage, NO_TOOL_CALL_MESSAGE));
                    NO_TOOL_CALL_MESSAGE.to_string()
                }
            }
        };
        if budget_hit {
            return Outcome {
                status: SampleStatus::Truncated,
                stop_reason: "context_budget",
                reached_terminal: false,
                error: None,
            };
        }
        if turn + 1 == env.config.max_turns {
            break;
        }
        let role = if reply_text == NO_TOOL_CALL_MESSAGE {
            "user"
        } else {
            "tool"
        };
        let message = json!({"role": role, "content": reply_text});
        match ctx.chat.continuation_ids(&generated, &message) {
            Ok(ids) => traj.push_context(&ids),
            Err(e) => return failed("template_error", format!("rendering turn {turn}: {e}")),
        }
    }
    Outcome {
        status: SampleStatus::Truncated,
        stop_reason: "max_turns",
        reached_terminal: false,
        error: None,
    }
}

/// The rollout event of an episode: where it ran and which sample it is.
fn rollout_info(env: &EnvironmentHandle, request: &EpisodeRequest, version: u64) -> RolloutInfo {
    let task = &request.task;
    let mut metadata = Map::new();
    metadata.insert("sample_id".into(), json!(request.sample_id));
    metadata.insert("group_index".into(), json!(request.group_index));
    metadata.insert("index".into(), json!(request.index));
    metadata.insert("task_hash".into(), json!(task.task_hash));
    metadata.insert("weight_version".into(), json!(version));
    RolloutInfo {
        rollout_name: format!(
            "{}:{}:{}:{}",
            env.name, task.split, task.task_hash, request.sample_id
        ),
        environment: env.name.clone(),
        split: task.split.clone(),
        metadata,
        task_spec: task.task_spec.clone(),
    }
}

/// How many of a turn's `generated_len` tokens are thinking, by the cookbook's rule
/// (generate.py's `_find_think_boundary`): the text through the first `</think>` and
/// the newlines, carriage returns and spaces after it, counted as the tokens
/// `count_tokens` encodes it into, at most the turn's tokens; 0 without `</think>`.
pub fn thinking_boundary(
    text: &str,
    generated_len: usize,
    count_tokens: impl Fn(&str) -> usize,
) -> usize {
    let Some(at) = text.find("</think>") else {
        return 0;
    };
    let after = at + "</think>".len();
    let rest = &text[after..];
    let end = after + (rest.len() - rest.trim_start_matches(['\n', '\r', ' ']).len());
    count_tokens(&text[..end]).min(generated_len)
}

/// The visible part of a turn (chat markers such as `<|im_end|>` removed): a `reasoning`
/// message for a `<think>` block, then the text before the tool call (the call itself is
/// its own message). A turn without a valid call is always recorded, tags included, so
/// the transcript shows what the model wrote.
fn assistant_messages(generated: &str, parsed: &ParsedTurn) -> Vec<Message> {
    let visible = strip_chat_markers(generated);
    let mut out = Vec::new();
    let mut text = visible.as_str();
    if let Some(end) = text.find("</think>") {
        let thought = text[..end].trim_start_matches("<think>").trim();
        if !thought.is_empty() {
            out.push(Message::new(MessageType::Reasoning, thought));
        }
        text = &text[end + "</think>".len()..];
    }
    let text = match parsed {
        ParsedTurn::Call(_) => text
            .find(TOOL_CALL_OPEN)
            .map_or(text, |i| &text[..i])
            .trim(),
        _ => text.trim(),
    };
    if !text.is_empty() || !matches!(parsed, ParsedTurn::Call(_)) {
        out.push(Message::new(MessageType::AssistantMessage, text));
    }
    out
}

/// Removes `<|…|>` markers (turn and sequence ends), which are not part of the message.
fn strip_chat_markers(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("<|") {
        match rest[start + 2..].find("|>") {
            Some(end) => {
                out.push_str(&rest[..start]);
                rest = &rest[start + 2 + end + 2..];
            }
            None => break,
        }
    }
    out.push_str(rest);
    out
}

fn tool_call_message(name: &str, arguments: &Map<String, Value>, call_id: &str) -> Message {
    Message {
        name: Some(name.to_string()),
        call_id: Some(call_id.to_string()),
        ..Message::new(
            MessageType::ToolCall,
            dumps(&Value::Object(arguments.clone())),
        )
    }
}

fn tool_result_message(text: &str, reward: Option<f64>, finished: bool, call_id: &str) -> Message {
    Message {
        call_id: Some(call_id.to_string()),
        reward,
        is_finished: finished,
        ..Message::new(MessageType::ToolResult, text)
    }
}

fn terminal() -> Outcome {
    Outcome {
        status: SampleStatus::Completed,
        stop_reason: "terminal",
        reached_terminal: true,
        error: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ors::ToolSpec;

    #[test]
    fn thinking_boundary_is_the_cookbooks() {
        let chars = |t: &str| t.chars().count();
        assert_eq!(thinking_boundary("no tags here", 12, chars), 0);
        let text = "<think>a</think>\n \r\nanswer";
        assert_eq!(thinking_boundary(text, 100, chars), 20);
        // Tabs are not in the cookbook's whitespace set; the count is capped.
        assert_eq!(thinking_boundary("</think>\tx", 100, chars), 8);
        assert_eq!(thinking_boundary(text, 5, chars), 5);
    }

    #[test]
    fn assistant_text_drops_markers_and_the_call() {
        let turn = "<think>\nhmm\n</think>\n\nLet me add.<tool_call>\n{\"name\": \"add\"}\n</tool_call><|im_end|>";
        let msgs = assistant_messages(turn, &parse_tool_call(turn));
        let got: Vec<(&str, &str)> = msgs
            .iter()
            .map(|m| (m.kind.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(
            got,
            [("reasoning", "hmm"), ("assistant_message", "Let me add.")]
        );
        let plain = "42<|im_end|><|endoftext|>";
        let msgs = assistant_messages(plain, &parse_tool_call(plain));
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].content, "42");
    }

    #[test]
    fn tools_text_uses_the_cookbook_keys_and_python_separators() {
        let listing = ToolsListing {
            tools: vec![ToolSpec {
                name: "add".into(),
                description: "Add to the counter.".into(),
                input_schema: Some(
                    json!({"type": "object", "properties": {"amount": {"type": "integer"}}}),
                ),
            }],
            terminal_tool: None,
        };
        assert_eq!(
            tools_text(&listing),
            "{\"name\": \"add\", \"arguments_schema\": {\"type\": \"object\", \"properties\": {\"amount\": {\"type\": \"integer\"}}}, \"description\": \"Add to the counter.\"}"
        );
    }
}
