//! A `driver serve` child process for the HTTP tests: started on a free port, ready once
//! it prints its URL (after its warm-up generate), killed on drop.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

pub struct Server {
    child: Child,
    pub base: String,
    http: reqwest::Client,
}

impl Server {
    /// Runs `BIN serve --model-path MODEL --host 127.0.0.1 --port 0 --random-seed 1 ARGS`.
    pub fn start(bin: impl AsRef<OsStr>, model: &Path, args: &[&str]) -> Server {
        let mut child = Command::new(bin)
            .args(["serve", "--model-path"])
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", "0", "--random-seed", "1"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start driver serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let base = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(url) = line.strip_prefix("driver serve: ready on ") {
                        break url.trim().to_string();
                    }
                }
                _ => {
                    let status = child.wait().expect("wait");
                    panic!("driver serve exited before it was ready: {status}");
                }
            }
        };
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server {
            child,
            base,
            http: reqwest::Client::new(),
        }
    }

    /// POSTs `body` as JSON; (status, the answer as JSON, or as a string if it is not).
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.http.post(format!("{}{path}", self.base)).json(&body);
        answer(r.send().await.expect("POST")).await
    }

    /// POSTs `body` verbatim as `application/json` (malformed-input tests).
    pub async fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string());
        answer(r.send().await.expect("POST")).await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = self.http.get(format!("{}{path}", self.base));
        answer(r.send().await.expect("GET")).await
    }

    /// A `/generate` that must succeed.
    pub async fn generate(&self, body: Value) -> Value {
        let (status, v) = self.post("/generate", body.clone()).await;
        assert_eq!(status, 200, "generate {body} answered {v}");
        v
    }

    pub async fn weight_version(&self) -> String {
        let (status, v) = self.get("/get_weight_version").await;
        assert_eq!(status, 200);
        v["weight_version"]
            .as_str()
            .unwrap_or_else(|| panic!("weight_version is not a string: {v}"))
            .to_string()
    }
}

async fn answer(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
