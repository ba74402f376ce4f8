//! What a run leaves behind for people: console logs, `metrics.jsonl`, TensorBoard
//! event files, and a PNG plot.

pub mod logging;
pub mod metrics;
pub mod plot;
pub mod tensorboard;

pub use logging::init_logging;
pub use metrics::{read_metrics, MetricsWriter, StepMetrics};
pub use plot::{plot_reward_and_loss, PlotError};
pub use tensorboard::TensorBoardWriter;
