//! Conversion between [`Sample`] and its protobuf form `manta.common.Sample`,
//! with validation so a malformed message is refused with a clear error.

use manta_proto::common as pb;

use crate::sample::{EpisodeMetadata, PrefixCacheUse, RoutedExperts, Sample, SampleStatus};

/// A protobuf sample that cannot be a valid [`Sample`].
#[derive(Debug, thiserror::Error)]
#[error("malformed manta.common.Sample: {0}")]
pub struct WireError(pub String);

impl From<SampleStatus> for pb::SampleStatus {
    fn from(s: SampleStatus) -> Self {
        match s {
            SampleStatus::Completed => pb::SampleStatus::Completed,
            SampleStatus::Truncated => pb::SampleStatus::Truncated,
            SampleStatus::Aborted => pb::SampleStatus::Aborted,
            SampleStatus::Failed => pb::SampleStatus::Failed,
        }
    }
}

impl From<&Sample> for pb::Sample {
    fn from(s: &Sample) -> Self {
        pb::Sample {
            id: s.id,
            group_index: s.group_index,
            index: s.index,
            tokens: s.tokens.clone(),
            response_length: s.response_length as u32,
            loss_mask: s.loss_mask.iter().map(|&m| m as u32).collect(),
            rollout_log_probs: s.rollout_log_probs.clone(),
            reward: s.reward as f32,
            status: pb::SampleStatus::from(s.status) as i32,
            weight_version: s.weight_version,
            metadata: Some(pb::EpisodeMetadata {
                environment: s.metadata.environment.clone(),
                task_hash: s.metadata.task_hash.clone(),
                stop_reason: s.metadata.stop_reason.clone(),
                num_tool_calls: s.metadata.num_tool_calls,
                num_failed_tool_calls: s.metadata.num_failed_tool_calls,
                step_rewards: s.metadata.step_rewards.clone(),
                num_turns: s.metadata.num_turns,
                error: s.metadata.error.clone().unwrap_or_default(),
                engine_restarts: s.metadata.engine_restarts,
                weight_versions: s.metadata.weight_versions.clone(),
                prefix_cache: Some(pb::PrefixCacheUse {
                    first_turn_prompt: s.metadata.prefix_cache.first_turn_prompt,
                    first_turn_cached: s.metadata.prefix_cache.first_turn_cached,
                    later_turns_prompt: s.metadata.prefix_cache.later_turns_prompt,
                    later_turns_cached: s.metadata.prefix_cache.later_turns_cached,
                }),
            }),
            routed_experts: s.routed_experts.as_ref().map(|r| pb::RoutedExperts {
                layers: r.layers,
                top_k: r.top_k,
                ids: r.ids.clone(),
            }),
        }
    }
}

impl TryFrom<pb::Sample> for Sample {
    type Error = WireError;

    fn try_from(p: pb::Sample) -> Result<Self, WireError> {
        let status = match pb::SampleStatus::try_from(p.status) {
            Ok(pb::SampleStatus::Completed) => SampleStatus::Completed,
            Ok(pb::SampleStatus::Truncated) => SampleStatus::Truncated,
            Ok(pb::SampleStatus::Aborted) => SampleStatus::Aborted,
            Ok(pb::SampleStatus::Failed) => SampleStatus::Failed,
            Ok(pb::SampleStatus::Unspecified) | Err(_) => {
                return Err(WireError(format!(
                    "sample {}: status {} is not a known SampleStatus",
                    p.id, p.status
                )))
            }
        };
        let loss_mask = p
            .loss_mask
            .iter()
            .map(|&m| {
                u8::try_from(m).ok().filter(|&m| m <= 1).ok_or_else(|| {
                    WireError(format!(
                        "sample {}: loss_mask value {m} is not 0 or 1",
                        p.id
                    ))
                })
            })
            .collect::<Result<Vec<u8>, WireError>>()?;
        let meta = p.metadata.unwrap_or_default();
        let cache = meta.prefix_cache.unwrap_or_default();
        if cache.first_turn_cached > cache.first_turn_prompt
            || cache.later_turns_cached > cache.later_turns_prompt
        {
            return Err(WireError(format!(
                "sample {}: prefix_cache counts more cached tokens than prompt tokens ({cache:?})",
                p.id
            )));
        }
        let sample = Sample {
            id: p.id,
            group_index: p.group_index,
            index: p.index,
            tokens: p.tokens,
            response_length: p.response_length as usize,
            loss_mask,
            rollout_log_probs: p.rollout_log_probs,
            reward: p.reward as f64,
            status,
            weight_version: p.weight_version,
            metadata: EpisodeMetadata {
                environment: meta.environment,
                task_hash: meta.task_hash,
                stop_reason: meta.stop_reason,
                num_turns: meta.num_turns,
                num_tool_calls: meta.num_tool_calls,
                num_failed_tool_calls: meta.num_failed_tool_calls,
                step_rewards: meta.step_rewards,
                error: (!meta.error.is_empty()).then_some(meta.error),
                engine_restarts: meta.engine_restarts,
                weight_versions: meta.weight_versions,
                prefix_cache: PrefixCacheUse {
                    first_turn_prompt: cache.first_turn_prompt,
                    first_turn_cached: cache.first_turn_cached,
                    later_turns_prompt: cache.later_turns_prompt,
                    later_turns_cached: cache.later_turns_cached,
                },
            },
            routed_experts: p.routed_experts.map(|r| RoutedExperts {
                layers: r.layers,
                top_k: r.top_k,
                ids: r.ids,
            }),
        };
        sample.validate().map_err(WireError)?;
        Ok(sample)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn sample() -> Sample {
        Sample {
            id: 7,
            group_index: 1,
            index: 2,
            tokens: vec![1, 2, 3, 4, 5],
            response_length: 3,
            loss_mask: vec![1, 0, 1],
            rollout_log_probs: vec![-0.5, 0.0, -1.25],
            reward: 0.5,
            status: SampleStatus::Truncated,
            weight_version: 4,
            metadata: EpisodeMetadata {
                environment: "manta/Digits".into(),
                stop_reason: "max_turns".into(),
                step_rewards: vec![0.25, 0.25],
                num_turns: 2,
                weight_versions: vec![4, 4, 5],
                prefix_cache: PrefixCacheUse {
                    first_turn_prompt: 40,
                    first_turn_cached: 32,
                    later_turns_prompt: 90,
                    later_turns_cached: 80,
                },
                ..Default::default()
            },
            routed_experts: Some(RoutedExperts {
                layers: 2,
                top_k: 2,
                ids: (0..16).map(|i| i % 5 - 1).collect(),
            }),
        }
    }

    #[test]
    fn round_trips_through_protobuf_bytes() {
        let s = sample();
        let bytes = pb::Sample::from(&s).encode_to_vec();
        let back = Sample::try_from(pb::Sample::decode(bytes.as_slice()).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn refuses_mask_length_mismatch_and_names_it() {
        let mut p = pb::Sample::from(&sample());
        p.loss_mask.pop();
        let err = Sample::try_from(p).unwrap_err().to_string();
        assert!(err.contains("loss_mask has 2 entries"), "{err}");
    }

    #[test]
    fn refuses_unknown_status_and_bad_mask_values() {
        let mut p = pb::Sample::from(&sample());
        p.status = 99;
        assert!(Sample::try_from(p)
            .unwrap_err()
            .to_string()
            .contains("status 99"));
        let mut p = pb::Sample::from(&sample());
        p.loss_mask[0] = 7;
        assert!(Sample::try_from(p)
            .unwrap_err()
            .to_string()
            .contains("loss_mask value 7"));
    }

    #[test]
    fn refuses_routed_experts_of_the_wrong_shape() {
        let mut p = pb::Sample::from(&sample());
        if let Some(r) = p.routed_experts.as_mut() {
            r.ids.pop();
        }
        let err = Sample::try_from(p).unwrap_err().to_string();
        assert!(err.contains("routed_experts holds 15 ids"), "{err}");
        let mut p = pb::Sample::from(&sample());
        if let Some(r) = p.routed_experts.as_mut() {
            r.ids.extend([0; 8]);
        }
        let err = Sample::try_from(p).unwrap_err().to_string();
        assert!(err.contains("6 rows for 5 tokens"), "{err}");
    }

    #[test]
    fn refuses_more_cached_than_prompt_tokens() {
        let mut p = pb::Sample::from(&sample());
        if let Some(cache) = p.metadata.as_mut().and_then(|m| m.prefix_cache.as_mut()) {
            cache.later_turns_cached = 91;
        }
        let err = Sample::try_from(p).unwrap_err().to_string();
        assert!(err.contains("prefix_cache"), "{err}");
    }

    #[test]
    fn prefix_cache_use_splits_first_and_later_turns() {
        let mut use_ = PrefixCacheUse::default();
        use_.record(0, 100, 64);
        use_.record(1, 150, 140);
        use_.record(2, 200, 500); // an engine cannot cache more than it was sent
        assert_eq!(
            use_,
            PrefixCacheUse {
                first_turn_prompt: 100,
                first_turn_cached: 64,
                later_turns_prompt: 350,
                later_turns_cached: 340,
            }
        );
    }
}
