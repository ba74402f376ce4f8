//! Episode requests to and from `manta.rollout` messages.

use manta_proto::rollout as pb;
use manta_rollout::{EpisodeRequest, TaskRef};

/// An episode request as it crosses gRPC (the task spec as JSON).
pub fn request_to_pb(r: &EpisodeRequest) -> pb::EpisodeRequest {
    pb::EpisodeRequest {
        sample_id: r.sample_id,
        group_index: r.group_index,
        index: r.index,
        task: Some(pb::Task {
            environment: r.task.environment.clone(),
            split: r.task.split.clone(),
            task_spec_json: r.task.task_spec.to_string(),
            task_hash: r.task.task_hash.clone(),
            server_env: r.task.server_env.clone(),
        }),
    }
}

/// Back from the wire; a missing task or bad JSON is named with the sample id.
pub fn request_from_pb(p: pb::EpisodeRequest) -> Result<EpisodeRequest, String> {
    let task = p
        .task
        .ok_or_else(|| format!("episode request for sample {} has no task", p.sample_id))?;
    let task_spec = serde_json::from_str(&task.task_spec_json).map_err(|e| {
        format!(
            "episode request for sample {}: task_spec_json is not JSON: {e}",
            p.sample_id
        )
    })?;
    Ok(EpisodeRequest {
        sample_id: p.sample_id,
        group_index: p.group_index,
        index: p.index,
        task: TaskRef {
            environment: task.environment,
            split: task.split,
            task_spec,
            task_hash: task.task_hash,
            server_env: task.server_env,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bad_json_is_named() {
        let r = EpisodeRequest {
            sample_id: 9,
            group_index: 1,
            index: 2,
            task: TaskRef {
                environment: "manta/Digits".into(),
                split: "train".into(),
                task_spec: serde_json::json!({"n": 3}),
                task_hash: "abc".into(),
                server_env: "digits".into(),
            },
        };
        assert_eq!(request_from_pb(request_to_pb(&r)).unwrap(), r);
        let mut p = request_to_pb(&r);
        p.task.as_mut().unwrap().task_spec_json = "{".into();
        let err = request_from_pb(p).unwrap_err();
        assert!(
            err.contains("sample 9") && err.contains("not JSON"),
            "{err}"
        );
    }
}
