//! Environments served by the real `openreward` SDK: a Python script started on a free
//! port, waited for until it answers `/health`, and killed when the test lets go of it.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running SDK server; killed when dropped.
pub struct SdkServer {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
}

impl SdkServer {
    /// Starts `script HOST PORT ARGS...` with the venv's Python and waits (up to a minute)
    /// until it answers `GET /health` with 200.
    pub fn start(script: &Path, args: &[&str]) -> SdkServer {
        let port = super::free_port();
        let child = Command::new(super::python())
            .arg(script)
            .args(["127.0.0.1", &port.to_string()])
            .args(args)
            .env("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "starting {} {} (set MANTA_PYTHON): {e}",
                    super::python().display(),
                    script.display()
                )
            });
        let server = SdkServer {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !answers_health(port) {
            assert!(
                Instant::now() < deadline,
                "SDK server {} did not come up on {}",
                script.display(),
                server.base
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        server
    }

    /// Kills the server now (an environment that dies mid-run).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for SdkServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether the server on `port` answers `GET /health` with 200.
fn answers_health(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.write_all(b"GET /health HTTP/1.0\r\n\r\n");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200")
}
