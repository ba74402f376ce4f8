//! `[trainer] ranks`: data-parallel trainer ranks on worker daemons, one entry per rank
//! in rank order (`ranks = [{ node = 0, gpu = 0 }, { node = 1, gpu = 1 }]`; CPU ranks
//! leave `gpu` out). A list of (node, GPU) pairs rather than `node` + `gpus` because
//! ranks may sit on several nodes and several GPUs of one node, and rank 0's place
//! matters: its worker makes the NCCL id (or hosts the CPU ranks' store) and roots the
//! weight sync to the engines.
//!
//! Also here: where the trainer's GPUs are on a node, whichever key placed them
//! ([`TrainerSection::gpus_on`]), so engine placement skips them.

use std::path::Path;

use serde::Deserialize;

use crate::cluster::{ClusterMode, NodeConfig, TrainerSection};
use crate::error::ConfigError;

/// Where one trainer rank runs: a `[[nodes]]` index and, for GPU ranks, a GPU that node
/// offers.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TrainerRankPlace {
    pub node: usize,
    #[serde(default)]
    pub gpu: Option<u32>,
}

impl TrainerSection {
    /// Whether the trainer lives on workers: one on `node`, or ranks on `ranks`' nodes.
    pub fn on_workers(&self) -> bool {
        self.node.is_some() || !self.ranks.is_empty()
    }

    /// The node hosting the trainer, or its rank 0: the root of a weight-update group.
    pub fn root_node(&self) -> Option<usize> {
        self.ranks.first().map(|r| r.node).or(self.node)
    }

    /// GPUs of the trainer (or of its rank 0) on its node: where a broadcast to the
    /// engines starts.
    pub fn root_gpus(&self) -> Vec<u32> {
        match self.ranks.first() {
            Some(r) => r.gpu.into_iter().collect(),
            None => self.gpus.clone(),
        }
    }

    /// GPUs that trainer ranks (or the one trainer) take on node `node`.
    pub fn gpus_on(&self, node: usize) -> Vec<u32> {
        if !self.ranks.is_empty() {
            return self
                .ranks
                .iter()
                .filter(|r| r.node == node)
                .filter_map(|r| r.gpu)
                .collect();
        }
        if self.node == Some(node) {
            return self.gpus.clone();
        }
        Vec::new()
    }
}

/// `trainer.ranks`: remote mode only, instead of `trainer.node`/`gpus`/
/// `data_parallel_ranks`; every node exists and offers its rank's GPU; all ranks on
/// GPUs (NCCL) or none (the store group), and no GPU taken twice.
pub(crate) fn validate(
    t: &TrainerSection,
    mode: ClusterMode,
    nodes: &[NodeConfig],
    path: &Path,
) -> Result<(), ConfigError> {
    if t.ranks.is_empty() {
        return Ok(());
    }
    let shown = |ranks: &[TrainerRankPlace]| {
        let each: Vec<String> = ranks
            .iter()
            .map(|r| match r.gpu {
                Some(g) => format!("{{ node = {}, gpu = {g} }}", r.node),
                None => format!("{{ node = {} }}", r.node),
            })
            .collect();
        format!("[{}]", each.join(", "))
    };
    if mode != ClusterMode::Remote {
        return Err(ConfigError::invalid(
            path,
            "trainer.ranks",
            shown(&t.ranks),
            "ranks on worker nodes need cluster.mode = \"remote\"; in local mode use \
             trainer.gpus or trainer.data_parallel_ranks",
        ));
    }
    for (key, set) in [
        ("trainer.node", t.node.is_some()),
        ("trainer.gpus", !t.gpus.is_empty()),
        (
            "trainer.data_parallel_ranks",
            t.data_parallel_ranks.is_some(),
        ),
    ] {
        if set {
            return Err(ConfigError::invalid(
                path,
                key,
                "set",
                "trainer.ranks places every rank (node and GPU): leave this key out",
            ));
        }
    }
    let n = nodes.len();
    for (i, r) in t.ranks.iter().enumerate() {
        if r.node >= n {
            return Err(ConfigError::invalid(
                path,
                format!("trainer.ranks[{i}].node"),
                r.node,
                format!(
                    "there are {n} [[nodes]] (indices 0..{})",
                    n.saturating_sub(1)
                ),
            ));
        }
        if let Some(g) = r.gpu {
            let offered = &nodes[r.node].gpus;
            if !offered.contains(&g) {
                return Err(ConfigError::invalid(
                    path,
                    format!("trainer.ranks[{i}].gpu"),
                    g,
                    format!("GPU {g} is not among nodes[{}].gpus {offered:?}", r.node),
                ));
            }
        }
        if r.gpu.is_some() != t.ranks[0].gpu.is_some() {
            return Err(ConfigError::invalid(
                path,
                format!("trainer.ranks[{i}].gpu"),
                r.gpu.map_or("absent".to_string(), |g| g.to_string()),
                "either every rank has a GPU (NCCL between them) or none has (CPU ranks \
                 through rank 0's store); rank 0 decides",
            ));
        }
        if let Some(j) = t.ranks[..i]
            .iter()
            .position(|o| r.gpu.is_some() && o.node == r.node && o.gpu == r.gpu)
        {
            return Err(ConfigError::invalid(
                path,
                format!("trainer.ranks[{i}]"),
                shown(&t.ranks[i..=i]),
                format!("rank {j} already takes that GPU: one rank per GPU"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::{ClusterConfig, TrainerRankPlace};
    use std::path::Path;

    const TWO_NODES: &str = "[[nodes]]\naddress = \"a:1\"\ngpus = [0, 1]\n\n\
                             [[nodes]]\naddress = \"b:1\"\ngpus = [0, 1]\n";

    fn remote(trainer: &str, rest: &str) -> Result<ClusterConfig, String> {
        let text =
            format!("[cluster]\nmode = \"remote\"\n\n[trainer]\n{trainer}\n\n{rest}\n{TWO_NODES}");
        ClusterConfig::from_toml_str(&text, Path::new("conf/cluster.toml"))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn ranks_on_two_nodes_take_their_gpus_from_the_engines() {
        let c = remote(
            "ranks = [{ node = 0, gpu = 1 }, { node = 1, gpu = 0 }]",
            "[rollout]\nengines = 1\ngpus_per_engine = 1\n",
        )
        .unwrap();
        assert_eq!(
            c.trainer.ranks,
            vec![
                TrainerRankPlace {
                    node: 0,
                    gpu: Some(1)
                },
                TrainerRankPlace {
                    node: 1,
                    gpu: Some(0)
                }
            ]
        );
        assert_eq!(c.trainer.root_node(), Some(0));
        assert_eq!(c.trainer.root_gpus(), vec![1]);
        // Each node's engine takes the GPU its rank leaves.
        assert_eq!(c.engine_gpus(0, 0), vec![0]);
        assert_eq!(c.engine_gpus(1, 0), vec![1]);
        // CPU ranks: no GPU anywhere.
        let cpu = remote("ranks = [{ node = 0 }, { node = 1 }]", "").unwrap();
        assert!(cpu.trainer.root_gpus().is_empty() && cpu.trainer.on_workers());
    }

    #[test]
    fn a_bad_placement_is_refused_by_key_and_value() {
        let cases = [
            (
                "ranks = [{ node = 0 }, { node = 2 }]",
                "trainer.ranks[1].node",
                "value 2",
            ),
            (
                "ranks = [{ node = 0, gpu = 0 }, { node = 1, gpu = 7 }]",
                "trainer.ranks[1].gpu",
                "value 7",
            ),
            (
                "ranks = [{ node = 0, gpu = 0 }, { node = 1 }]",
                "trainer.ranks[1].gpu",
                "absent",
            ),
            (
                "ranks = [{ node = 1, gpu = 1 }, { node = 1, gpu = 1 }]",
                "trainer.ranks[1]",
                "rank 0 already takes that GPU",
            ),
            (
                "node = 0\nranks = [{ node = 0 }]",
                "trainer.node",
                "leave this key out",
            ),
            (
                "data_parallel_ranks = 2\nranks = [{ node = 0 }]",
                "trainer.data_parallel_ranks",
                "",
            ),
        ];
        for (trainer, key, detail) in cases {
            let err = remote(trainer, "").unwrap_err();
            assert!(
                err.contains("conf/cluster.toml")
                    && err.contains(&format!("`{key}`"))
                    && err.contains(detail),
                "{trainer}: {err}"
            );
        }
        // Local mode has no nodes to place ranks on.
        let err = ClusterConfig::from_toml_str(
            "[trainer]\nranks = [{ node = 0 }]\n",
            Path::new("conf/cluster.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("`trainer.ranks`") && err.contains("{ node = 0 }"),
            "{err}"
        );
        // GPU ranks cannot feed engines through the CPU store.
        let err = remote("ranks = [{ node = 0, gpu = 0 }, { node = 1, gpu = 0 }]", "")
            .map(|_| ())
            .and_then(|_| {
                let text = format!(
                    "[cluster]\nmode = \"remote\"\nworker_weights = \"store\"\n\n[trainer]\n\
                 ranks = [{{ node = 0, gpu = 0 }}, {{ node = 1, gpu = 0 }}]\n\n{TWO_NODES}"
                );
                ClusterConfig::from_toml_str(&text, Path::new("c.toml"))
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
            .unwrap_err();
        assert!(
            err.contains("cluster.worker_weights") && err.contains("GPU"),
            "{err}"
        );
    }
}
