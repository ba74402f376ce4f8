use super::*;

fn parse(text: &str) -> Result<ClusterConfig, ConfigError> {
    ClusterConfig::from_toml_str(text, Path::new("conf/cluster.toml"))
}

#[test]
fn empty_file_is_local_mode_with_defaults() {
    let c = parse("").unwrap();
    assert_eq!(c.mode, ClusterMode::Local);
    assert_eq!(c.rollout.max_concurrent_episodes, 64);
    assert!(c.train_config.is_none());
}

#[test]
fn train_config_is_relative_to_the_cluster_file() {
    let c = parse("[cluster]\ntrain_config = \"t.yaml\"\n").unwrap();
    assert_eq!(c.train_config.unwrap(), Path::new("conf/t.yaml"));
}

#[test]
fn unknown_key_is_named_with_the_file() {
    let err = parse("[rollout]\nengins = 2\n").unwrap_err().to_string();
    assert!(err.starts_with("conf/cluster.toml"), "{err}");
    assert!(err.contains("engins"), "{err}");
}

#[test]
fn wrong_type_is_named() {
    let err = parse("[train]\nlr = \"fast\"\n").unwrap_err().to_string();
    assert!(err.contains("lr"), "{err}");
    assert!(err.contains("fast") || err.contains("string"), "{err}");
}

#[test]
fn remote_mode_parses_nodes_and_timeouts() {
    let c = parse(
        "[cluster]\nmode = \"remote\"\nheartbeat_interval_ms = 200\n\n[[nodes]]\naddress = \"127.0.0.1:7001\"\ngpus = [0, 1]\n\n[[nodes]]\naddress = \"10.0.0.2:7001\"\n",
    )
    .unwrap();
    assert_eq!(c.mode, ClusterMode::Remote);
    assert_eq!(c.nodes.len(), 2);
    assert_eq!(c.nodes[0].gpus, vec![0, 1]);
    assert_eq!((c.heartbeat_interval_ms, c.dead_after_ms), (200, 3000));
    assert_eq!(c.lease_timeout_ms, 10_000);
}

#[test]
fn local_mode_places_the_trainer_and_engines_on_this_machines_gpus() {
    let c =
        parse("[trainer]\ngpus = [0]\n\n[rollout]\nengines = 2\ngpus_per_engine = 1\n").unwrap();
    assert_eq!(c.trainer.gpus, vec![0]);
    assert_eq!(c.local_engine_gpus(0), vec![1]);
    assert_eq!(c.local_engine_gpus(1), vec![2]);
    let shared = parse(
        "[trainer]\ngpus = [0]\n\n[rollout]\nengines = 1\ngpus_per_engine = 1\ncolocate = true\n",
    )
    .unwrap();
    assert_eq!(shared.local_engine_gpus(0), vec![0]);
    assert!(parse("").unwrap().local_engine_gpus(0).is_empty());
}

#[test]
fn data_parallel_ranks_come_from_the_gpus_or_the_key() {
    assert_eq!(parse("").unwrap().trainer.data_parallel_world(), 1);
    let cpu = parse("[trainer]\ndata_parallel_ranks = 3\n").unwrap();
    assert_eq!(cpu.trainer.data_parallel_world(), 3);
    let gpus = parse("[trainer]\ngpus = [0, 1]\n").unwrap();
    assert_eq!(gpus.trainer.data_parallel_world(), 2);
    let same = parse("[trainer]\ngpus = [2, 3]\ndata_parallel_ranks = 2\n").unwrap();
    assert_eq!(same.trainer.data_parallel_world(), 2);
}

#[test]
fn bad_data_parallel_ranks_are_named() {
    let err = parse("[trainer]\ndata_parallel_ranks = 0\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("trainer.data_parallel_ranks")
            && err.contains("value 0")
            && err.contains("at least 1"),
        "{err}"
    );
    let err = parse("[trainer]\ngpus = [0, 1]\ndata_parallel_ranks = 3\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("trainer.data_parallel_ranks")
            && err.contains("value 3")
            && err.contains("[0, 1]")
            && err.contains("one rank per GPU (2)"),
        "{err}"
    );
    let err = parse(
        "[cluster]\nmode = \"remote\"\n\n[trainer]\ndata_parallel_ranks = 2\n\n\
         [[nodes]]\naddress = \"a:1\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("trainer.data_parallel_ranks") && err.contains("trainer.ranks"),
        "{err}"
    );
}

#[test]
fn trainer_and_rollout_roles_place_on_nodes() {
    let c = parse(
        "[cluster]\nmode = \"remote\"\n\n[trainer]\nnode = 1\ngpus = [0]\non_failure = \"stop\"\n\n\
         [rollout]\nengines = 2\ngpus_per_engine = 1\nnodes = [1]\n\n\
         [[nodes]]\naddress = \"a:1\"\n\n[[nodes]]\naddress = \"b:1\"\ngpus = [0, 1, 2]\n",
    )
    .unwrap();
    assert_eq!(c.trainer.node, Some(1));
    assert_eq!(c.trainer.on_failure, TrainerFailurePolicy::Stop);
    assert_eq!(c.rollout_nodes(), vec![1]);
    // The trainer keeps GPU 0; engines take the others in order.
    assert_eq!(c.engine_gpus(1, 0), vec![1]);
    assert_eq!(c.engine_gpus(1, 1), vec![2]);
    assert_eq!(c.trainer.restart_timeout_s, 120);
}

#[test]
fn placement_that_cannot_fit_is_refused_naming_the_node() {
    let base = "[cluster]\nmode = \"remote\"\n\n[[nodes]]\naddress = \"a:1\"\ngpus = [0, 1]\n";
    let err = parse(&format!(
        "{base}\n[trainer]\nnode = 0\ngpus = [0]\n\n[rollout]\nengines = 2\ngpus_per_engine = 1\n"
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("nodes[0].gpus") && err.contains("needs 3 GPUs"),
        "{err}"
    );
    // Colocated engines share the trainer's GPUs: it fits.
    parse(&format!("{base}\n[trainer]\nnode = 0\ngpus = [0]\n\n[rollout]\nengines = 2\ngpus_per_engine = 1\ncolocate = true\n")).unwrap();
    let err = parse(&format!("{base}\n[trainer]\nnode = 3\n"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("trainer.node") && err.contains('3'), "{err}");
    let err = parse(&format!("{base}\n[trainer]\nnode = 0\ngpus = [7]\n"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("trainer.gpus") && err.contains("GPU 7"),
        "{err}"
    );
    let err = parse(&format!("{base}\n[rollout]\nnodes = [0, 2]\n"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rollout.nodes") && err.contains("node 2"),
        "{err}"
    );
    let err = parse("[trainer]\nnode = 0\n").unwrap_err().to_string();
    assert!(
        err.contains("trainer.node") && err.contains("remote"),
        "{err}"
    );
}

#[test]
fn remote_mode_errors_name_key_and_value() {
    let err = parse("[cluster]\nmode = \"remote\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("nodes") && err.contains("at least one"),
        "{err}"
    );
    let err = parse("[cluster]\nmode = \"remote\"\n[[nodes]]\naddress = \"localhost\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("nodes[0].address") && err.contains("localhost"),
        "{err}"
    );
    let err =
        parse("[cluster]\nmode = \"remote\"\ndead_after_ms = 500\n[[nodes]]\naddress = \"h:1\"\n")
            .unwrap_err()
            .to_string();
    assert!(
        err.contains("cluster.dead_after_ms") && err.contains("500"),
        "{err}"
    );
    let err = parse(
        "[cluster]\nmode = \"remote\"\nlease_timeout_ms = 2000\n[[nodes]]\naddress = \"h:1\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("cluster.lease_timeout_ms") && err.contains("2000"),
        "{err}"
    );
    let err = parse("[[nodes]]\naddress = \"h:1\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("only used with"), "{err}");
}

#[test]
fn worker_weights_by_broadcast_root_at_the_trainer_in_the_driver_or_on_its_worker() {
    let remote = "[cluster]\nmode = \"remote\"\n";
    let node = "[[nodes]]\naddress = \"w:7100\"\n";
    let c = parse(&format!("{remote}{node}")).unwrap();
    assert_eq!(c.worker_weights, WorkerWeights::Grpc);
    let c = parse(&format!(
        "{remote}worker_weights = \"store\"\ndriver_address = \"10.0.0.1\"\n{node}"
    ))
    .unwrap();
    assert_eq!(
        (c.worker_weights, c.driver_address.as_str()),
        (WorkerWeights::Store, "10.0.0.1")
    );
    let err = parse("[cluster]\nworker_weights = \"store\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cluster.worker_weights") && err.contains("remote"),
        "{err}"
    );
    // Rank 0 on the trainer's worker: NCCL from its GPU, the store from its CPU.
    let two_nodes = "[[nodes]]\naddress = \"a:7100\"\ngpus = [0]\n\n\
                     [[nodes]]\naddress = \"b:7100\"\ngpus = [0]\n";
    let c = parse(&format!(
        "{remote}worker_weights = \"nccl\"\n\n[trainer]\nnode = 0\ngpus = [0]\n\n\
         [rollout]\nnodes = [1]\ngpus_per_engine = 1\n\n{two_nodes}"
    ))
    .unwrap();
    assert_eq!(
        (c.worker_weights, c.trainer.node),
        (WorkerWeights::Nccl, Some(0))
    );
    let c = parse(&format!(
        "{remote}worker_weights = \"store\"\n\n[trainer]\nnode = 0\n\n{node}"
    ))
    .unwrap();
    assert_eq!(
        (c.worker_weights, c.trainer.node),
        (WorkerWeights::Store, Some(0))
    );
    let err = parse(&format!(
        "{remote}worker_weights = \"nccl\"\n\n[trainer]\nnode = 0\n\n{two_nodes}"
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("trainer.gpus") && err.contains("\"nccl\""),
        "{err}"
    );
    let err = parse(&format!(
        "{remote}worker_weights = \"store\"\n\n[trainer]\nnode = 0\ngpus = [0]\n\n{two_nodes}"
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("cluster.worker_weights")
            && err.contains("\"store\"")
            && err.contains("CPU tensors"),
        "{err}"
    );
    let err = parse(&format!(
        "{remote}worker_weights = \"nccl\"\n\n[trainer]\nnode = 0\ngpus = [0]\n\n\
         [rollout]\ncolocate = true\ngpus_per_engine = 1\n\n{two_nodes}"
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("cluster.worker_weights") && err.contains("rollout.colocate"),
        "{err}"
    );
    let err = parse(&format!("{remote}worker_weights = \"nccl\"\n{node}"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("trainer.gpus"), "{err}");
    let err = parse(&format!("{remote}worker_weights = \"udp\"\n{node}"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("udp"), "{err}");
}

#[test]
fn tls_ca_is_resolved_checked_and_remote_only() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.toml");
    let remote = "[cluster]\nmode = \"remote\"\n";
    let node = "[[nodes]]\naddress = \"worker-1:7100\"\n";
    let load = |cluster_lines: &str| {
        std::fs::write(&file, format!("{remote}{cluster_lines}{node}")).unwrap();
        ClusterConfig::from_file(&file)
    };
    assert_eq!(load("").unwrap().tls, None);

    let err = load("tls_ca = \"certs/ca.pem\"\n").unwrap_err().to_string();
    assert!(
        err.contains("cluster.tls_ca")
            && err.contains("certs/ca.pem")
            && err.contains("cannot read"),
        "{err}"
    );
    std::fs::create_dir(dir.path().join("certs")).unwrap();
    std::fs::write(dir.path().join("certs/ca.pem"), "not a certificate").unwrap();
    let err = load("tls_ca = \"certs/ca.pem\"\n").unwrap_err().to_string();
    assert!(err.contains("no PEM certificate"), "{err}");

    std::fs::write(
        dir.path().join("certs/ca.pem"),
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let tls = load("tls_ca = \"certs/ca.pem\"\ntls_domain = \"workers.internal\"\n")
        .unwrap()
        .tls
        .unwrap();
    assert_eq!(tls.ca, dir.path().join("certs/ca.pem"));
    assert_eq!(tls.domain.as_deref(), Some("workers.internal"));

    let err = load("tls_ca = \"certs/ca.pem\"\ntls_domain = \"a b\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cluster.tls_domain") && err.contains("a b"),
        "{err}"
    );
    let err = load("tls_domain = \"x\"\n").unwrap_err().to_string();
    assert!(
        err.contains("only used together with cluster.tls_ca"),
        "{err}"
    );
    std::fs::write(&file, "[cluster]\ntls_ca = \"certs/ca.pem\"\n").unwrap();
    let err = ClusterConfig::from_file(&file).unwrap_err().to_string();
    assert!(
        err.contains("cluster.tls_ca") && err.contains("remote"),
        "{err}"
    );
}

#[test]
fn bad_value_names_key_and_value() {
    let err = parse("[rollout]\nmax_batch_size = 0\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rollout.max_batch_size") && err.contains(" 0"),
        "{err}"
    );
    let err = parse("[train]\nlr = -1.0\n").unwrap_err().to_string();
    assert!(err.contains("train.lr") && err.contains("-1"), "{err}");
    let err = parse("[rollout]\nengine = \"vllm\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("vllm"), "{err}");
}

#[test]
fn sglang_engine_keys() {
    let c = parse(
        "[rollout]\nengine = \"sglang\"\ncommand = [\"driver\", \"serve\"]\n\
         mem_fraction_static = 0.7\nextra_args = [\"--log-level\", \"warning\"]\n",
    )
    .unwrap();
    assert_eq!(c.rollout.engine, EngineKind::Sglang);
    assert_eq!(c.rollout.command.as_deref().map(|c| c.len()), Some(2));
    assert_eq!(c.rollout.health_timeout_s, 600);
    let err = parse("[rollout]\nengine = \"sglang\"\ncommand = []\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("rollout.command"), "{err}");
    let err = parse("[rollout]\nmem_fraction_static = 1.5\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rollout.mem_fraction_static") && err.contains("1.5"),
        "{err}"
    );
}
