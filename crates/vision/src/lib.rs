//! OCR as a task, whichever engine runs the models.
//!
//! Images (PNG, JPEG, WebP, TIFF, BMP) and PDF pages are decoded under limits checked
//! before any pixel is allocated; the PP-OCR stages around the three models — the
//! detector's resize and DB post-processing into rotated boxes, the perspective crop,
//! the direction classifier's turn, the recogniser's CTC decoding — are plain functions
//! on tensors, so the server runs each stage as a model the core loads, batches and
//! evicts like any other.
//!
//! Every rule and default follows rapidocr 3.10 (its `ch_ppocr_det`, `ch_ppocr_cls`,
//! `ch_ppocr_rec`, `utils` and `config.yaml`), including OpenCV's exact resize, warp
//! and polygon-fill arithmetic, so the same models give the same lines; where this
//! crate departs from it (a crash or a misplaced box in rapidocr) the function says so.
//!
//! A page, in order: [`Document::open`] and [`Document::render_page`] (or
//! [`decode_image`]) give a [`BgrImage`]; [`prepare_page`] bounds and pads it;
//! [`det_input`] → detector → [`text_boxes`]; [`crop_box`] per box; [`plan_batches`]
//! then [`cls_input`] → classifier → [`cls_decode`] / [`apply_orientation`]; again
//! [`plan_batches`] then [`rec_input`] → recogniser → [`CtcDecoder::decode`];
//! [`assemble_page`]. [`read_page`] does all of it with the models behind a closure.

mod batch;
mod bgr;
mod cls;
mod contour;
mod crop;
mod db;
mod decode;
mod det;
mod document;
mod error;
pub mod geometry;
pub mod jobs;
mod limits;
mod options;
mod page;
pub mod pdf;
mod pipeline;
pub mod raster;
mod rec;
pub mod resize;
mod tiff_pages;
pub mod unclip;

pub use batch::{plan_batches, ratio};
pub use bgr::BgrImage;
pub use cls::{apply_orientation, cls_decode, cls_input, Direction, Orientation};
pub use contour::{find_contours, Contour};
pub use crop::{crop_box, perspective_transform, warp_cubic};
pub use db::{boxes_from_map, filter_boxes, probability_map, sort_boxes, text_boxes, TextBox};
pub use decode::{decode_image, ImageKind};
pub use det::{det_input, prepare_page, PageGeometry, PreparedPage};
pub use document::{Document, DocumentKind, PageImage};
pub use error::{ErrorClass, VisionError};
pub use geometry::Quad;
pub use limits::{InputLimits, PageSelection};
pub use options::{LimitType, OcrOptions};
pub use page::{assemble_page, Line, Page};
pub use pipeline::{read_page, Stage, StageTimes};
pub use rec::{rec_input, CtcDecoder};
pub use tiff_pages::TiffPages;
