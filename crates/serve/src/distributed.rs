//! SGLang's NCCL weight-update routes on `driver serve`: `/init_weights_update_group`,
//! `/update_weights_from_distributed`, `/destroy_weights_update_group`.
//!
//! A trainer (rank 0) hosts torch.distributed's TCPStore and broadcasts; this server joins
//! the group as rank `rank_offset` (one device, so no tensor-parallel ranks to add) through
//! libtorch's `ProcessGroupNCCL` (`manta_cuda::process_group`, wire-compatible with
//! SGLang's `init_custom_process_group`), receives each tensor by `broadcast(src=0)` in
//! the order of the request's names, and hands them to the engine, which copies them into
//! its parameters at a request boundary and takes the new weight version.
//!
//! Answers are SGLang's: `{"success", "message"}`, 200 when done, 400 otherwise. Every
//! check (fields, tensor names, shapes, dtypes, the group) runs before the first byte is
//! received, so a refused request never leaves the group half-way through a broadcast.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use manta_cuda::process_group::{GroupSpec, ProcessGroup};
use manta_engine::{Engine, NamedTensors, NativeEngine};
use serde::Deserialize;
use serde_json::json;
use tch::{Device, Kind, Tensor};
use tracing::{info, warn};

use super::wire;

/// SGLang's default group name.
const DEFAULT_GROUP: &str = "weight_update_group";

/// How long joining (reaching the trainer's store) and each broadcast may take.
const GROUP_TIMEOUT: Duration = Duration::from_secs(600);

fn default_group() -> String {
    DEFAULT_GROUP.to_string()
}

fn default_backend() -> String {
    "nccl".to_string()
}

fn yes() -> bool {
    true
}

/// `/init_weights_update_group` (SGLang's `InitWeightsUpdateGroupReqInput`).
#[derive(Debug, Deserialize)]
pub struct InitGroupBody {
    pub master_address: String,
    pub master_port: u16,
    pub rank_offset: usize,
    pub world_size: usize,
    #[serde(default = "default_group")]
    pub group_name: String,
    #[serde(default = "default_backend")]
    pub backend: String,
}

/// `/update_weights_from_distributed` (SGLang's `UpdateWeightsFromDistributedReqInput`).
#[derive(Debug, Deserialize)]
pub struct UpdateFromDistributedBody {
    pub names: Vec<String>,
    pub dtypes: Vec<String>,
    pub shapes: Vec<Vec<i64>>,
    #[serde(default = "default_group")]
    pub group_name: String,
    /// The engine drops its prefix cache on every weight change, so `false` is not honoured.
    #[serde(default = "yes")]
    pub flush_cache: bool,
    #[serde(default)]
    pub abort_all_requests: bool,
    #[serde(default)]
    pub weight_version: Option<String>,
    #[serde(default)]
    pub load_format: Option<String>,
}

/// `/destroy_weights_update_group`.
#[derive(Debug, Deserialize)]
pub struct DestroyGroupBody {
    #[serde(default = "default_group")]
    pub group_name: String,
}

type SharedGroup = Arc<Mutex<ProcessGroup>>;

/// The engine and the weight-update groups it has joined, by name.
pub struct WeightGroups {
    engine: Arc<NativeEngine>,
    device: Device,
    groups: Mutex<HashMap<String, SharedGroup>>,
}

impl WeightGroups {
    pub fn new(engine: Arc<NativeEngine>, device: Device) -> Self {
        Self {
            engine,
            device,
            groups: Mutex::new(HashMap::new()),
        }
    }

    fn group(&self, name: &str) -> Option<SharedGroup> {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    fn remove(&self, name: &str) -> Option<SharedGroup> {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)
    }
}

/// The three routes, to merge into the server's router.
pub fn router(state: Arc<WeightGroups>) -> Router {
    Router::new()
        .route("/init_weights_update_group", post(init_group))
        .route(
            "/update_weights_from_distributed",
            post(update_from_distributed),
        )
        .route("/destroy_weights_update_group", post(destroy_group))
        .with_state(state)
}

fn answer(status: StatusCode, success: bool, message: String) -> Response {
    if !success {
        warn!("{message}");
    }
    (
        status,
        Json(json!({"success": success, "message": message})),
    )
        .into_response()
}

fn refused(message: String) -> Response {
    answer(StatusCode::BAD_REQUEST, false, message)
}

fn done(message: String) -> Response {
    answer(StatusCode::OK, true, message)
}

async fn init_group(State(state): State<Arc<WeightGroups>>, body: Bytes) -> Response {
    let body: InitGroupBody = match wire::parse_body(&body) {
        Ok(b) => b,
        Err(e) => return refused(e.0),
    };
    if body.backend != "nccl" {
        return refused(format!(
            "backend: {:?} is not supported (the native engine receives weights over NCCL: \"nccl\")",
            body.backend
        ));
    }
    if body.rank_offset == 0 {
        return refused(
            "rank_offset: 0 is the trainer's rank (the broadcast root); an engine is rank 1 or above"
                .into(),
        );
    }
    if body.master_port == 0 {
        return refused("master_port: 0 is not the port of a store".into());
    }
    let spec = GroupSpec {
        master_address: body.master_address.clone(),
        master_port: body.master_port,
        rank: body.rank_offset,
        world_size: body.world_size,
        group_name: body.group_name.clone(),
        device: match state.device {
            Device::Cuda(i) => i,
            _ => 0,
        },
        timeout: GROUP_TIMEOUT,
    };
    if let Err(e) = spec.validate() {
        return refused(e.message);
    }
    if !matches!(state.device, Device::Cuda(_)) {
        return refused(format!(
            "group_name {:?}: NCCL needs a CUDA device, and this server runs on the CPU (--device)",
            body.group_name
        ));
    }
    if state.group(&body.group_name).is_some() {
        return refused(format!(
            "group_name: {:?} already exists (destroy it first)",
            body.group_name
        ));
    }
    // Reaching the store can wait for the trainer: off the async runtime.
    let joined = tokio::task::spawn_blocking(move || ProcessGroup::join(spec)).await;
    match joined {
        Ok(Ok(group)) => {
            let mut groups = state.groups.lock().unwrap_or_else(|e| e.into_inner());
            if groups.contains_key(&body.group_name) {
                return refused(format!(
                    "group_name: {:?} already exists (destroy it first)",
                    body.group_name
                ));
            }
            groups.insert(body.group_name.clone(), Arc::new(Mutex::new(group)));
            info!(
                group = %body.group_name,
                master = %format!("{}:{}", body.master_address, body.master_port),
                rank = body.rank_offset,
                world_size = body.world_size,
                "joined the weight update group"
            );
            done("Succeeded to initialize custom process group.".into())
        }
        Ok(Err(e)) => refused(format!("Failed to initialize custom process group: {e}")),
        Err(e) => refused(format!("joining the group panicked: {e}")),
    }
}

/// A torch dtype name as SGLang's callers write it (`bfloat16`, `torch.bfloat16`).
fn parse_dtype(name: &str) -> Option<Kind> {
    Some(match name.strip_prefix("torch.").unwrap_or(name) {
        "bfloat16" => Kind::BFloat16,
        "float16" | "half" => Kind::Half,
        "float32" | "float" => Kind::Float,
        "float64" | "double" => Kind::Double,
        "int64" | "long" => Kind::Int64,
        "int32" | "int" => Kind::Int,
        "int8" => Kind::Int8,
        "uint8" => Kind::Uint8,
        "bool" => Kind::Bool,
        _ => return None,
    })
}

/// Checks an update against the engine's parameters and returns what to receive, in
/// order; the message names the field and index.
fn plan_update(
    body: &UpdateFromDistributedBody,
    params: &[(String, Vec<i64>, Kind)],
) -> Result<Vec<(String, Vec<i64>, Kind)>, String> {
    if body.names.is_empty() {
        return Err("names: empty (nothing to update)".into());
    }
    if body.dtypes.len() != body.names.len() || body.shapes.len() != body.names.len() {
        return Err(format!(
            "names, dtypes, shapes: {} names, {} dtypes and {} shapes (one of each per tensor)",
            body.names.len(),
            body.dtypes.len(),
            body.shapes.len()
        ));
    }
    if let Some(f) = body.load_format.as_deref().filter(|f| *f != "auto") {
        return Err(format!(
            "load_format: {f:?} is not supported (tensors are received as named)"
        ));
    }
    let by_name: HashMap<&str, &Vec<i64>> =
        params.iter().map(|(n, s, _)| (n.as_str(), s)).collect();
    let mut seen = HashSet::new();
    let mut plan = Vec::with_capacity(body.names.len());
    for (i, ((name, dtype), shape)) in body
        .names
        .iter()
        .zip(&body.dtypes)
        .zip(&body.shapes)
        .enumerate()
    {
        let Some(expected) = by_name.get(name.as_str()) else {
            return Err(format!(
                "names[{i}]: unknown tensor {name:?} (not a parameter of this model)"
            ));
        };
        if !seen.insert(name.as_str()) {
            return Err(format!("names[{i}]: {name:?} is given twice"));
        }
        if shape != *expected {
            return Err(format!(
                "shapes[{i}]: tensor {name} has shape {expected:?} in this model, the request says {shape:?}"
            ));
        }
        let Some(kind) = parse_dtype(dtype) else {
            return Err(format!(
                "dtypes[{i}]: {dtype:?} is not a torch dtype this server receives (bfloat16, float16, float32, ...)"
            ));
        };
        plan.push((name.clone(), shape.clone(), kind));
    }
    Ok(plan)
}

async fn update_from_distributed(State(state): State<Arc<WeightGroups>>, body: Bytes) -> Response {
    let body: UpdateFromDistributedBody = match wire::parse_body(&body) {
        Ok(b) => b,
        Err(e) => return refused(e.0),
    };
    let params = match state.engine.weight_shapes().await {
        Ok(p) => p,
        Err(e) => return refused(format!("cannot read the engine's parameters: {e}")),
    };
    let plan = match plan_update(&body, &params) {
        Ok(p) => p,
        Err(m) => return refused(m),
    };
    let version = match body.weight_version.as_deref() {
        Some(v) => match v.trim().parse::<u64>() {
            Ok(n) => n,
            Err(_) => {
                return refused(format!(
                    "weight_version: {v:?} is not a non-negative integer (the native engine numbers its weight versions)"
                ))
            }
        },
        None => state.engine.weight_version().saturating_add(1),
    };
    let Some(group) = state.group(&body.group_name) else {
        return refused(format!(
            "group_name: no weight update group {:?} on this server (call /init_weights_update_group first)",
            body.group_name
        ));
    };
    if !body.flush_cache {
        info!("flush_cache false: the native engine drops its prefix cache on every weight change");
    }
    if body.abort_all_requests {
        if let Err(e) = state.engine.abort(None).await {
            return refused(format!("cannot abort running requests: {e}"));
        }
    }
    let Device::Cuda(_) = state.device else {
        return refused("NCCL needs a CUDA device, and this server runs on the CPU".into());
    };
    let device = state.device;
    let count = plan.len();
    let received = tokio::task::spawn_blocking(move || -> Result<NamedTensors, String> {
        let tensors: NamedTensors = plan
            .into_iter()
            .map(|(name, shape, kind)| (name, Tensor::empty(shape.as_slice(), (kind, device))))
            .collect();
        let mut group = group.lock().unwrap_or_else(|e| e.into_inner());
        group.broadcast(&tensors, 0).map_err(|e| e.to_string())?;
        Ok(tensors)
    })
    .await;
    let tensors = match received {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            // The communicator's state is unknown after a failed collective.
            state.remove(&body.group_name);
            return refused(format!(
                "Failed to receive the weights: {e}; the group {:?} is destroyed on this server",
                body.group_name
            ));
        }
        Err(e) => return refused(format!("receiving the weights panicked: {e}")),
    };
    match state.engine.update_some_weights(tensors, version).await {
        Ok(()) => {
            info!(tensors = count, version, group = %body.group_name, "weights updated from distributed");
            done(format!(
                "Succeeded to update parameter online. Weight version updated to {version}."
            ))
        }
        Err(e) => refused(format!("Failed to update parameter online: {e}")),
    }
}

async fn destroy_group(State(state): State<Arc<WeightGroups>>, body: Bytes) -> Response {
    let body: DestroyGroupBody = match wire::parse_body(&body) {
        Ok(b) => b,
        Err(e) => return refused(e.0),
    };
    let Some(group) = state.remove(&body.group_name) else {
        return refused(format!(
            "group_name: no weight update group {:?} on this server",
            body.group_name
        ));
    };
    // Shutting NCCL down can block briefly: off the async runtime.
    let _ = tokio::task::spawn_blocking(move || drop(group)).await;
    info!(group = %body.group_name, "destroyed the weight update group");
    done("Succeeded to destroy custom process group.".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Vec<(String, Vec<i64>, Kind)> {
        vec![
            ("a.weight".into(), vec![4, 2], Kind::BFloat16),
            ("b.bias".into(), vec![4], Kind::BFloat16),
        ]
    }

    fn body(v: serde_json::Value) -> UpdateFromDistributedBody {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn an_update_is_checked_against_the_parameters_before_receiving() {
        let ok = body(
            json!({"names": ["b.bias", "a.weight"], "dtypes": ["torch.bfloat16", "float32"], "shapes": [[4], [4, 2]]}),
        );
        let plan = plan_update(&ok, &params()).unwrap();
        assert_eq!(plan[0].0, "b.bias", "the request's order is kept");
        assert_eq!(plan[1].2, Kind::Float, "received in the dtype sent");
        let cases = [
            (
                json!({"names": [], "dtypes": [], "shapes": []}),
                "names: empty",
            ),
            (
                json!({"names": ["a.weight"], "dtypes": [], "shapes": [[4, 2]]}),
                "1 names, 0 dtypes",
            ),
            (
                json!({"names": ["c"], "dtypes": ["bfloat16"], "shapes": [[1]]}),
                "names[0]: unknown tensor \"c\"",
            ),
            (
                json!({"names": ["b.bias", "b.bias"], "dtypes": ["bfloat16", "bfloat16"], "shapes": [[4], [4]]}),
                "names[1]",
            ),
            (
                json!({"names": ["a.weight"], "dtypes": ["bfloat16"], "shapes": [[2, 4]]}),
                "shapes[0]",
            ),
            (
                json!({"names": ["a.weight"], "dtypes": ["complex32"], "shapes": [[4, 2]]}),
                "dtypes[0]",
            ),
            (
                json!({"names": ["a.weight"], "dtypes": ["bfloat16"], "shapes": [[4, 2]], "load_format": "flattened_bucket"}),
                "load_format",
            ),
        ];
        for (v, want) in cases {
            let e = plan_update(&body(v.clone()), &params()).expect_err(&v.to_string());
            assert!(e.contains(want), "{v}: {e}");
        }
    }
}
