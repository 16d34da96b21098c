//! Small-multiples line plots for `train --plot` and `report --plot`: one panel per
//! codec family, the fp32 reference in black in every panel, each variant of the family
//! in its own colour and marker shape (a colour-blind-safe palette, no repeats within a
//! panel), error feedback dashed in its variant's colour, and every legend beside its
//! panel, outside the data, its labels wrapped to the legend's width. A line that lies on
//! an earlier one (within 1% everywhere) says so in the legend, since only one of them
//! shows.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

/// One line.
pub struct Series {
    pub name: String,
    pub pts: Vec<(f64, f64)>,
    /// Drawn dashed (error feedback), in the colour of the solid series of the same
    /// `variant`.
    pub dashed: bool,
    /// Series of one variant share a colour.
    pub variant: usize,
}

/// One panel: a codec family.
pub struct Panel {
    pub title: String,
    pub series: Vec<Series>,
}

/// The axes every panel shares.
pub struct Axes {
    pub x: (f64, f64),
    pub x_log: bool,
    pub x_label: String,
    pub y_label: String,
    /// A vertical line at this x, with its label (the network a report was asked about).
    pub mark_x: Option<(f64, String)>,
}

/// Okabe and Ito's colour-blind-safe palette, without its yellow (too light on white).
const PALETTE: [RGBColor; 6] = [
    RGBColor(0x00, 0x72, 0xB2),
    RGBColor(0xD5, 0x5E, 0x00),
    RGBColor(0x00, 0x9E, 0x73),
    RGBColor(0xCC, 0x79, 0xA7),
    RGBColor(0xE6, 0x9F, 0x00),
    RGBColor(0x56, 0xB4, 0xE9),
];

/// The family a spec belongs to in the plots: its codec name, with the 16-bit floats and
/// natural with ternary sharing a panel.
pub fn family(spec: &str) -> &'static str {
    match spec.split(':').next().unwrap_or(spec) {
        "fp16" | "bf16" => "fp16, bf16",
        "fp8" | "fp4" => "fp8, fp4",
        "codebook" => "codebook",
        "int8" => "int8",
        "qsgd" => "QSGD",
        "natural" | "ternary" => "natural, ternary",
        "sign" => "sign",
        "topk" | "chunktopk" => "top-k",
        "randk" => "random-k",
        "dct" => "dct",
        "powersgd" => "PowerSGD",
        _ => "other",
    }
}

/// Group `(spec, series)` pairs into panels by [`family`], in first-seen order.
pub fn by_family(series: Vec<(String, Series)>) -> Vec<Panel> {
    let mut panels: Vec<Panel> = Vec::new();
    for (spec, s) in series {
        let title = family(&spec);
        match panels.iter_mut().find(|p| p.title == title) {
            Some(p) => p.series.push(s),
            None => panels.push(Panel {
                title: title.to_string(),
                series: vec![s],
            }),
        }
    }
    panels
}

/// Draw `panels` (two columns) with `reference` in every one, log-scaled y shared by all.
pub fn small_multiples(
    path: &Path,
    title: &str,
    panels: &[Panel],
    reference: &Series,
    axes: &Axes,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let ys = panels
        .iter()
        .flat_map(|p| p.series.iter())
        .chain(std::iter::once(reference))
        .flat_map(|s| s.pts.iter().map(|p| p.1))
        .filter(|y| y.is_finite() && *y > 0.0);
    let (lo, hi) = ys.fold((f64::INFINITY, 0f64), |(a, b), y| (a.min(y), b.max(y)));
    let (lo, hi) = if lo.is_finite() && hi > 0.0 {
        (lo * 0.85, hi * 1.15)
    } else {
        (0.1, 10.0)
    };
    let cols = 2;
    let rows = panels.len().div_ceil(cols).max(1);
    let root = SVGBackend::new(path, (1400, 60 + 300 * rows as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| err(&e))?;
    let cells = root.split_evenly((rows, cols));
    for (panel, cell) in panels.iter().zip(cells.iter()) {
        draw_panel(cell, panel, reference, axes, (lo, hi)).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

type DrawResult =
    Result<(), DrawingAreaErrorKind<<SVGBackend<'static> as DrawingBackend>::ErrorType>>;

fn draw_panel(
    cell: &DrawingArea<SVGBackend<'_>, Shift>,
    panel: &Panel,
    reference: &Series,
    axes: &Axes,
    (lo, hi): (f64, f64),
) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let (w, _) = cell.dim_in_pixel();
    let (plot_area, legend) = cell.split_horizontally(w * 56 / 100);
    let mut builder = ChartBuilder::on(&plot_area);
    builder
        .caption(&panel.title, ("sans-serif", 17))
        .margin(8)
        .x_label_area_size(34)
        .y_label_area_size(52);
    let style = |s: &Series| {
        if s.variant == usize::MAX {
            BLACK.stroke_width(3)
        } else {
            PALETTE[s.variant % PALETTE.len()].stroke_width(2)
        }
    };
    let series: Vec<&Series> = std::iter::once(reference).chain(&panel.series).collect();
    let labels = legend_labels(&series);
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(axes.x_label.as_str())
                .y_desc(axes.y_label.as_str())
                .label_style(("sans-serif", 12))
                // Within a decade the log axis needs more labels to show any but 1.
                .y_labels(if hi / lo <= 10.0 { 10 } else { 6 })
                .y_label_formatter(&|v| short(*v))
                .x_label_formatter(&|v| short(*v))
                .max_light_lines(3)
                .draw()
                .map_err(|x| e(&x))?;
            if let Some((x, label)) = &axes.mark_x {
                let grey = RGBColor(0x60, 0x60, 0x60);
                chart
                    .draw_series(DashedLineSeries::new(
                        vec![(*x, lo), (*x, hi)],
                        4,
                        4,
                        grey.stroke_width(1),
                    ))
                    .map_err(|v| e(&v))?;
                chart
                    .draw_series(std::iter::once(Text::new(
                        label.clone(),
                        (*x, hi / 1.02),
                        ("sans-serif", 12).into_font().color(&grey),
                    )))
                    .map_err(|v| e(&v))?;
            }
            for s in &series {
                if s.dashed {
                    chart
                        .draw_series(DashedLineSeries::new(s.pts.clone(), 7, 5, style(s)))
                        .map_err(|x| e(&x))?;
                } else {
                    chart
                        .draw_series(LineSeries::new(s.pts.clone(), style(s)))
                        .map_err(|x| e(&x))?;
                }
                if s.variant != usize::MAX {
                    // Markers at about 8 places along the line, shifted per variant so
                    // that lines on top of each other still show each marker.
                    let every = (s.pts.len() / 8).max(1);
                    let shift = (s.variant * every / 4) % every;
                    let c = PALETTE[s.variant % PALETTE.len()];
                    for &(x, y) in s.pts.iter().skip(shift).step_by(every) {
                        chart
                            .plotting_area()
                            .draw(&marker(s.variant, (x, y), c))
                            .map_err(|v| e(&v))?;
                    }
                }
            }
        }};
    }
    let (x0, x1) = axes.x;
    if axes.x_log {
        draw!(
            builder
                .build_cartesian_2d((x0..x1).log_scale(), (lo..hi).log_scale())
                .map_err(|x| e(&x))?
        );
    } else {
        draw!(
            builder
                .build_cartesian_2d(x0..x1, (lo..hi).log_scale())
                .map_err(|x| e(&x))?
        );
    }
    draw_legend(&legend, &series, &labels, style).map_err(|x| e(&x))
}

/// The characters of a legend label's line (13 px sans-serif in the legend's 280 px).
const LEGEND_CHARS: usize = 38;

/// Each series' legend label, wrapped at commas into lines of at most [`LEGEND_CHARS`],
/// with `(same as X)` where the line lies within 1% of an earlier series `X` at every
/// point (so that only one of them shows).
fn legend_labels(series: &[&Series]) -> Vec<Vec<String>> {
    series
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let same = series[..i].iter().find(|t| {
                t.pts.len() == s.pts.len()
                    && !s.pts.is_empty()
                    && s.pts.iter().zip(&t.pts).all(|(a, b)| {
                        a.0 == b.0 && (a.1 - b.1).abs() <= 0.01 * a.1.abs().max(b.1.abs())
                    })
            });
            let name = match same {
                Some(t) => format!("{} (same as {})", s.name, t.name),
                None => s.name.clone(),
            };
            wrap(&name, LEGEND_CHARS)
        })
        .collect()
}

/// `text` in lines of at most `width` characters, broken after commas or spaces where it
/// can be and inside a word only where a word is longer than a line.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    let mut word = String::new();
    let flush = |lines: &mut Vec<String>, word: &mut String| {
        let last = lines.last_mut().expect("one line");
        if !last.is_empty() && last.chars().count() + word.chars().count() > width {
            lines.push(String::new());
        }
        for ch in word.drain(..) {
            let last = lines.last_mut().expect("one line");
            if last.chars().count() == width {
                lines.push(String::new());
            }
            lines.last_mut().expect("one line").push(ch);
        }
    };
    for ch in text.chars() {
        word.push(ch);
        if ch == ',' || ch == ' ' {
            flush(&mut lines, &mut word);
        }
    }
    flush(&mut lines, &mut word);
    lines
        .into_iter()
        .map(|l| l.trim_end().to_string())
        .collect()
}

/// The marker of `variant`: circle, triangle, square, diamond, cross, in turn.
fn marker<'a, DB: DrawingBackend + 'a>(
    variant: usize,
    at: (f64, f64),
    c: RGBColor,
) -> DynElement<'a, DB, (f64, f64)> {
    let st = c.stroke_width(2);
    match variant % 5 {
        0 => Circle::new(at, 4, st).into_dyn(),
        1 => TriangleMarker::new(at, 5, st).into_dyn(),
        2 => (EmptyElement::at(at) + Rectangle::new([(-4, -4), (4, 4)], st)).into_dyn(),
        3 => (EmptyElement::at(at)
            + PathElement::new(vec![(0, -5), (5, 0), (0, 5), (-5, 0), (0, -5)], st))
        .into_dyn(),
        _ => Cross::new(at, 4, st).into_dyn(),
    }
}

/// An axis value with at most three significant digits and no trailing zeros (log axes
/// otherwise print `0.7000000000000001`).
fn short(v: f64) -> String {
    let s = format!("{:.3}", v);
    let s = if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        s
    };
    match s.contains('.') {
        true => s.trim_end_matches('0').trim_end_matches('.').to_string(),
        false => s,
    }
}

/// The legend beside a panel: a line sample (dashed where the series is, with its
/// marker) and the label's lines.
fn draw_legend(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    series: &[&Series],
    labels: &[Vec<String>],
    style: impl Fn(&Series) -> ShapeStyle,
) -> DrawResult {
    let mut y = 46;
    for (s, label) in series.iter().zip(labels) {
        let st = style(s);
        if s.dashed {
            area.draw(&PathElement::new(vec![(4, y), (12, y)], st))?;
            area.draw(&PathElement::new(vec![(18, y), (26, y)], st))?;
        } else {
            area.draw(&PathElement::new(vec![(4, y), (26, y)], st))?;
        }
        if s.variant != usize::MAX {
            let c = PALETTE[s.variant % PALETTE.len()];
            let st = c.stroke_width(2);
            match s.variant % 5 {
                0 => area.draw(&Circle::new((15, y), 4, st))?,
                1 => area.draw(&TriangleMarker::new((15, y), 5, st))?,
                2 => area.draw(&Rectangle::new([(11, y - 4), (19, y + 4)], st))?,
                3 => area.draw(&PathElement::new(
                    vec![(15, y - 5), (20, y), (15, y + 5), (10, y), (15, y - 5)],
                    st,
                ))?,
                _ => area.draw(&Cross::new((15, y), 4, st))?,
            }
        }
        for line in label {
            area.draw(&Text::new(
                line.clone(),
                (32, y - 7),
                ("sans-serif", 13).into_font().color(&BLACK),
            ))?;
            y += 16;
        }
        y += 4;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_wrap_at_commas_within_the_legend_width() {
        let spec = "randk:ratio=0.01,values=f32,scale=none,select=strata + EF";
        let lines = wrap(spec, LEGEND_CHARS);
        assert!(lines.len() > 1, "{lines:?}");
        assert!(
            lines.iter().all(|l| l.chars().count() <= LEGEND_CHARS),
            "{lines:?}"
        );
        assert_eq!(lines.concat().replace(' ', ""), spec.replace(' ', ""));
        assert!(lines[0].ends_with(','), "broken after a comma: {lines:?}");
        // A word longer than a line is cut inside it, and nothing is lost.
        let long = "x".repeat(90);
        let lines = wrap(&long, 38);
        assert_eq!(
            lines.iter().map(String::len).collect::<Vec<_>>(),
            [38, 38, 14]
        );
        assert_eq!(wrap("fp32", 38), ["fp32"]);
    }

    #[test]
    fn a_line_on_top_of_an_earlier_one_says_so() {
        let line = |name: &str, k: f64, variant| Series {
            name: name.into(),
            pts: (1..=8).map(|i| (i as f64, k * i as f64)).collect(),
            dashed: false,
            variant,
        };
        let (a, b, c) = (
            line("fp32", 1.0, usize::MAX),
            line("fp16", 1.005, 0),
            line("int8", 1.2, 1),
        );
        let labels = legend_labels(&[&a, &b, &c]);
        assert_eq!(labels[0], ["fp32"]);
        assert_eq!(labels[1], ["fp16 (same as fp32)"]);
        assert_eq!(labels[2], ["int8"]);
    }
}
