//! torch.distributed's TCPStore hosted by Manta (libtorch's implementation through the
//! shim) and joined by a real Python `torch.distributed.TCPStore` client, as an SGLang
//! engine joins its weight-update group's rendezvous: values cross both ways byte for
//! byte (NUL and non-UTF-8 bytes included), counters add up across members, and a store
//! nobody hosts is a clear error, not a hang.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use manta_cuda::rendezvous::TcpStore;

fn python() -> PathBuf {
    std::env::var_os("MANTA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"))
}

const PEER: &str = r#"
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False,
                      timeout=datetime.timedelta(seconds=30))
greeting = store.get("manta/greeting")
print(store.add("members", 5))
store.set("python/echo", greeting[::-1])
"#;

#[test]
fn a_python_torch_client_meets_manta_at_the_store() {
    let store = TcpStore::host(0, 2, Duration::from_secs(30)).expect("host a store");
    let port = store.port();
    assert_ne!(port, 0, "the store reports the port it chose");
    let greeting: Vec<u8> = vec![0, 1, 2, 255, 254, b'm', b'a', 0, 200];
    store.set("manta/greeting", &greeting).unwrap();
    let peer = std::thread::spawn(move || {
        Command::new(python())
            .args(["-c", PEER, &port.to_string()])
            .output()
            .expect("run python (set MANTA_PYTHON)")
    });
    // Waits until the peer has set it.
    let echo = store.get("python/echo").expect("the peer's answer");
    let mut reversed = greeting.clone();
    reversed.reverse();
    assert_eq!(echo, reversed);
    assert_eq!(store.add("members", 2).unwrap(), 7);
    let out = peer.join().unwrap();
    assert!(
        out.status.success(),
        "python peer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "5");

    // A second Rust member joins the same store and sees the same values.
    let member = TcpStore::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
    assert_eq!(member.get("python/echo").unwrap(), reversed);
    assert_eq!(member.add("members", 0).unwrap(), 7);
}

#[test]
fn nothing_to_meet_is_an_error_not_a_hang() {
    // A port nobody listens on (bind and drop to find one).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = match TcpStore::connect("127.0.0.1", port, Duration::from_millis(1500)) {
        Err(e) => e,
        Ok(_) => panic!("joined a store nobody hosts"),
    };
    assert_eq!(err.op, "connect");
    assert!(!err.message.is_empty(), "{err}");
    // A key nobody sets times out with its name in the error.
    let store = TcpStore::host(0, 1, Duration::from_millis(500)).unwrap();
    let err = store.get("never/set").expect_err("no one sets it");
    assert!(err.to_string().contains("never/set"), "{err}");
    // Keys with NUL cannot cross the C API: refused up front.
    assert!(store.set("bad\0key", b"x").is_err());
}
