//! The admission gate, in layers, each built only on those above it in this
//! list:
//!
//! - [`request`]: the request model (an admission request and its objects
//!   as the rules read them);
//! - [`decide`]: the rules, as pure functions of a request's parts and the
//!   tenant's state;
//! - [`judge`]: the one judge, [`judge::Judge::admit`]: which rules judge
//!   a request, in which order, and the reads they need;
//! - [`gate`]: makes those reads fresh from the API server and asks the
//!   judge again until it answers;
//! - [`review`]: the AdmissionReview wire format (decode, respond);
//! - [`server`]: the HTTP layer.

pub mod decide;
pub mod gate;
pub mod judge;
pub mod request;
pub mod review;
pub mod server;

pub use gate::Gate;
pub use server::router;
